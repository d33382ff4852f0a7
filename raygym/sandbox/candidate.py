"""The candidate's side of a graded run: it runs the candidate code, then answers the grader's
requests (look up a name, call, get an attribute or item, iterate...) through two pipes.

This module is shipped as source into the sandbox and runs in the candidate's own interpreter, so
nothing in it is trusted: the candidate may patch, replace or bypass all of it. What it sends back
is only ever read by the grader as plain values (see :mod:`raygym.sandbox.wire`), and the tests and
their expected values never enter this process.
"""

from __future__ import annotations

from raygym.sandbox import wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MUTABLE = (list, dict, set, bytearray)  # arguments whose state after a call goes back to the grader


class Server:
    """Answers requests about the objects of the namespace ``ns``; objects that are not plain values
    cross as handles (an index into ``objects``)."""

    def __init__(self, ns: dict[str, Any]) -> None:
        self.ns = ns
        self.objects: list[Any] = []
        self.index: dict[int, int] = {}

    def handle_of(self, obj: Any) -> tuple[int, str]:
        key = id(obj)
        if key not in self.index:
            self.index[key] = len(self.objects)
            self.objects.append(obj)
        return self.index[key], type(obj).__name__

    def answer(self, request: Any) -> Any:
        op, args = request[0], request[1:]
        if op == "get":
            if args[0] not in self.ns:
                raise NameError(f"name {args[0]!r} is not defined")
            return ("ok", self.ns[args[0]])
        target = args[0]
        if op == "call":
            call_args, call_kwargs = args[1], args[2]
            result = target(*call_args, **call_kwargs)
            after = (tuple(a if type(a) in MUTABLE else None for a in call_args),
                     {k: v for k, v in call_kwargs.items() if type(v) in MUTABLE})
            return ("ok", result, after)
        simple = {"attr": lambda: getattr(target, args[1]), "item": lambda: target[args[1]],
                  "len": lambda: len(target), "iter": lambda: iter(target), "next": lambda: next(target),
                  "bool": lambda: bool(target),
                  "str": lambda: str(target), "repr": lambda: repr(target)}
        if op in simple:
            return ("ok", simple[op]())
        if op == "setattr":
            setattr(target, args[1], args[2])
            return ("ok", None)
        if op == "setitem":
            target[args[1]] = args[2]
            return ("ok", None)
        raise ValueError(f"unknown request {op!r}")

    def reply(self, request: Any) -> bytes:
        try:
            return wire.dumps(self.answer(request), self.handle_of)
        except BaseException as exc:  # the candidate's own error (SystemExit included) is its answer
            try:
                message = str(exc)[:500]
            except BaseException:
                message = ""
            return wire.dumps(("raise", type(exc).__name__, message))

    def serve(self, request_fd: int, reply_fd: int, max_bytes: int) -> None:
        while True:
            try:
                frame = wire.read_frame(request_fd, max_bytes)
            except wire.ChannelClosed:
                return
            request = wire.loads(frame, lambda ident, _type: self.objects[ident])
            wire.write_frame(reply_fd, self.reply(request))


def main(request_fd: int, reply_fd: int, max_bytes: int, source: bytes) -> None:
    """Run ``source`` as the candidate code, say whether it loaded, then serve requests."""
    ns: dict[str, Any] = {"__name__": "__candidate__"}
    try:
        exec(compile(source.decode("utf-8", "surrogatepass"), "<candidate>", "exec"), ns)
    except BaseException as exc:
        ns.clear()  # what it allocated goes first (a MemoryError still gets reported)
        wire.write_frame(reply_fd, wire.dumps(("hello", type(exc).__name__)))
        raise SystemExit(1) from None
    wire.write_frame(reply_fd, wire.dumps(("hello", None)))
    Server(ns).serve(request_fd, reply_fd, max_bytes)
