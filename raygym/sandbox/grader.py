"""The grader of a graded run: a process of its own, which the candidate cannot see, signal or trace,
that runs each test (a Python statement such as ``assert f(2) == 4``) and prints the verdicts.

The tests run here, never in the candidate's interpreter. A name the test does not define itself
(``f``) is looked up in the candidate process through the channel and comes back as a plain value
(``int``, ``str``, ``list``...: built here by :func:`raygym.sandbox.wire.loads`) or as a
:class:`Remote` handle to a candidate object (a function, a class, an instance). So every comparison,
``==`` and ``in`` included, runs on the grader's own values with the grader's own builtins; a
candidate object cannot take part in one (a handle equals only itself), a value a test compares
against reaches the candidate only if the test passes it to the candidate's code, and patching ``int``, ``compile`` or the harness inside the
candidate changes nothing here. Builtin names (``abs``, ``len``, ``sorted``) are
always this process's builtins, never a candidate's function of the same name.

Calls copy their arguments to the candidate; a ``list``, ``dict``, ``set`` or ``bytearray`` argument
gets the candidate's changes back, so a test like ``xs = [3, 1]; sort_in_place(xs); assert xs == [1, 3]``
works. An exception the candidate raises is raised here as the builtin exception of the same name
(``ValueError``...; any other name, and ``AssertionError``, as :class:`CandidateError`), so tests can
expect one. A channel that closes or carries a malformed message ends the run (:class:`CandidateGone`):
the remaining tests fail.

Output, one line each, on the stdout it started with (read only by the sandbox's host process; a
test's own prints go to stderr): ``LOADED`` or
``LOAD <exception name>``, then ``PASS i``, ``FAIL i`` (an assertion failed), ``ERROR i <name>``,
``GONE i`` (the candidate is gone), and ``DONE``.

This module is shipped as source into the grader process (with :mod:`raygym.sandbox.wire`).
"""

from __future__ import annotations

import builtins
import os

from raygym.sandbox import wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Exceptions a candidate's error may become here: builtin Exception classes, never AssertionError
# (a test's own failed assertion) or a BaseException that is not an Exception (SystemExit...).
RAISABLE = {name: cls for name, cls in vars(builtins).items()
            if isinstance(cls, type) and issubclass(cls, Exception) and cls is not AssertionError}
BUILTIN_NAMES = frozenset(vars(builtins))


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin one (or an AssertionError)."""


class CandidateGone(BaseException):
    """The channel to the candidate closed or broke; a BaseException so a test's ``except Exception``
    cannot swallow it."""


class Channel:
    """Requests to the candidate process, one at a time, over two pipes."""

    def __init__(self, request_fd: int, reply_fd: int, max_bytes: int) -> None:
        self.request_fd, self.reply_fd, self.max_bytes = request_fd, reply_fd, max_bytes
        self.gone: str | None = None

    def handle_of(self, obj: Any) -> tuple[int, str]:
        if isinstance(obj, Remote) and object.__getattribute__(obj, "_channel") is self:
            return object.__getattribute__(obj, "_id"), object.__getattribute__(obj, "_type")
        raise TypeError(f"a {type(obj).__name__} cannot be passed to the candidate's code (only plain values can)")

    def receive(self) -> Any:
        if self.gone is not None:
            raise CandidateGone(self.gone)
        try:
            return wire.loads(wire.read_frame(self.reply_fd, self.max_bytes), lambda i, t: Remote(self, i, t))
        except (OSError, EOFError, wire.WireError) as exc:
            self.gone = f"{type(exc).__name__}: {exc}"
            raise CandidateGone(self.gone) from None

    def request(self, *message: Any) -> Any:
        payload = wire.dumps(message, self.handle_of)  # a TypeError here is the test's own mistake
        if self.gone is not None:
            raise CandidateGone(self.gone)
        try:
            wire.write_frame(self.request_fd, payload)
        except OSError as exc:
            self.gone = f"{type(exc).__name__}: {exc}"
            raise CandidateGone(self.gone) from None
        reply = self.receive()
        if type(reply) is tuple and len(reply) >= 2 and reply[0] == "ok":
            return reply[1:]
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise" and type(reply[1]) is str:
            raise candidate_exception(reply[1], reply[2])
        self.gone = "a malformed reply"
        raise CandidateGone(self.gone)

    def ask(self, *message: Any) -> Any:
        """The value in the reply to ``message``."""
        return self.request(*message)[0]

    def call(self, target: Remote, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        reply = self.request("call", target, args, kwargs)
        if len(reply) == 2 and type(reply[1]) is tuple and len(reply[1]) == 2:
            copy_back(args, kwargs, *reply[1])
        return reply[0]


def candidate_exception(name: str, message: Any) -> BaseException:
    cls = RAISABLE.get(name)
    text = message if type(message) is str else ""
    if cls is not None:
        try:
            return cls(text)
        except Exception:  # a constructor with other arguments (UnicodeDecodeError...)
            pass
    return CandidateError(f"{name}: {text}")


def copy_back(args: tuple[Any, ...], kwargs: dict[str, Any], after_args: Any, after_kwargs: Any) -> None:
    """Give the caller's mutable arguments the state they had in the candidate after the call."""
    pairs = list(zip(args, after_args if type(after_args) is tuple else (), strict=False))
    if type(after_kwargs) is dict:
        pairs += [(kwargs[k], v) for k, v in after_kwargs.items() if k in kwargs]
    for mine, theirs in pairs:
        if type(mine) is not type(theirs) or type(mine) not in (list, dict, set, bytearray):
            continue
        if type(mine) in (list, bytearray):
            mine[:] = theirs
        else:
            mine.clear()
            mine.update(theirs)


class Remote:
    """A candidate object (function, class, instance, iterator) seen from the grader. Calls, attributes,
    items, ``len``, iteration, truth, ``str`` and ``repr`` are asked of the candidate and come back as
    plain values or handles. Comparison never is: a handle equals only a handle to the same object, and
    ``x in handle`` iterates the object and compares here (asking would tell the candidate ``x``)."""

    __slots__ = ("_channel", "_id", "_type")

    def __init__(self, channel: Channel, ident: int, type_name: str) -> None:
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_type", type_name)

    def _ask(self, *message: Any) -> Any:
        return object.__getattribute__(self, "_channel").ask(*message)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return object.__getattribute__(self, "_channel").call(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._ask("attr", self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._ask("setattr", self, name, value)

    def __getitem__(self, key: Any) -> Any:
        return self._ask("item", self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ask("setitem", self, key, value)

    def __len__(self) -> int:
        return _checked(self._ask("len", self), int)

    def __iter__(self) -> Any:
        it = self._ask("iter", self)
        return _RemoteIterator(it) if isinstance(it, Remote) else iter(it)

    def __next__(self) -> Any:
        return self._ask("next", self)

    def __contains__(self, item: Any) -> bool:
        # Compared here, item by item: asking the candidate would tell it the value a test looks for.
        return any(element is item or element == item for element in self)

    def __bool__(self) -> bool:
        return _checked(self._ask("bool", self), bool)

    def __str__(self) -> str:
        return _checked(self._ask("str", self), str)

    def __repr__(self) -> str:
        return _checked(self._ask("repr", self), str)

    def __eq__(self, other: object) -> bool:
        get = object.__getattribute__
        return isinstance(other, Remote) and get(self, "_channel") is get(other, "_channel") and \
            get(self, "_id") == get(other, "_id")

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(object.__getattribute__(self, "_id"))


class _RemoteIterator:
    def __init__(self, remote: Remote) -> None:
        self.remote = remote

    def __iter__(self) -> _RemoteIterator:
        return self

    def __next__(self) -> Any:
        return next(self.remote)


def _checked(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"the candidate answered a {type(value).__name__} where Python needs a {kind.__name__}")
    return value


class RemoteNamespace(dict):  # type: ignore[type-arg]
    """The tests' globals: what a test does not define itself is looked up in the candidate process,
    except the builtins, which stay this process's own."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel

    def __missing__(self, name: str) -> Any:
        if type(name) is not str or name in BUILTIN_NAMES or name.startswith("__"):
            raise KeyError(name)
        try:
            return self.channel.ask("get", name)
        except NameError:
            raise KeyError(name) from None


def grade(tests: list[str], channel: Channel, emit: Any) -> None:
    """Wait for the candidate's hello, run ``tests`` in one shared :class:`RemoteNamespace` and
    ``emit`` one verdict line each."""
    try:
        hello = channel.receive()
    except CandidateGone:
        emit("LOAD exited")
        return
    if type(hello) is not tuple or len(hello) != 2 or hello[0] != "hello":
        emit("LOAD malformed")
        return
    if hello[1] is not None:
        emit(f"LOAD {hello[1] if type(hello[1]) is str and hello[1].isidentifier() else 'unknown'}")
        return
    emit("LOADED")
    ns = RemoteNamespace(channel)
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), ns)
        except AssertionError:
            emit(f"FAIL {index}")
        except CandidateGone:
            emit(f"GONE {index}")
            return
        except BaseException as exc:
            emit(f"ERROR {index} {type(exc).__name__}")
        else:
            emit(f"PASS {index}")


def main(request_fd: int, reply_fd: int, max_bytes: int, undumpable: bool, payload: bytes) -> None:
    """Grade the tests in ``payload`` (a wire-encoded list of str) and print the verdicts."""
    if undumpable:  # same uid as the candidate and no namespaces between them: no /proc/<pid>/mem, fd
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    tests = wire.loads(payload)
    # The verdicts keep the original stdout to themselves; what a test prints (maybe a candidate's
    # answer, maybe a forged verdict line) goes to stderr.
    verdicts = os.dup(1)
    os.dup2(2, 1)

    def emit(line: str) -> None:
        os.write(verdicts, (line + "\n").encode())

    grade(tests, Channel(request_fd, reply_fd, max_bytes), emit)
    emit("DONE")
