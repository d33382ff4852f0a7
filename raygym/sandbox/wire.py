"""Plain values on the wire between the grader and the candidate process: a small tagged binary
format and length-prefixed frames on pipes.

Only plain values travel: ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``,
``bytearray``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``, ``range``, and *handles*: a
number standing for a candidate object that stays in the candidate process. A subclass of a plain
type (``Counter``, a namedtuple, an ``int`` with its own ``__eq__``) crosses as a value of its base
type, read through the base type's own methods: its overrides stay behind. The decoder builds only these (a handle becomes whatever ``make_handle`` returns), never runs code, and
rejects malformed or oversized input with :class:`WireError`, so it is safe on bytes a hostile
program wrote.

This module is also shipped as source into the sandboxed processes, so it imports only ``os`` and
``struct``.

>>> loads(dumps([1, "a", (2.5, None), {"k": {True}}]))
[1, 'a', (2.5, None), {'k': {True}}]
"""

from __future__ import annotations

import os
import struct

TYPE_CHECKING = False  # typing is not imported at run time: the sandboxed processes start faster
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MAX_DEPTH = 100
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_LEN = struct.Struct("<I")


class WireError(ValueError):
    """Bytes that are not a well-formed message (or a frame over the size limit)."""


class ChannelClosed(EOFError):
    """The other end closed the channel (or died) before a whole frame arrived."""


class Handle:
    """What :func:`loads` makes of a handle when no ``make_handle`` is given."""

    __slots__ = ("id", "type_name")

    def __init__(self, id: int, type_name: str) -> None:
        self.id, self.type_name = id, type_name

    def __repr__(self) -> str:
        return f"Handle({self.id}, {self.type_name!r})"


_CONTAINER_TAGS: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z", dict: b"d"}


def dumps(value: Any, handle_of: Callable[[Any], tuple[int, str]] | None = None) -> bytes:
    """Encode ``value``; ``handle_of(obj) -> (id, type name)`` encodes what is not plain (without it,
    a non-plain value raises ``TypeError``)."""
    out = bytearray()
    _dump(value, out, handle_of, 0)
    return bytes(out)


# The plain families, most specific first; a subclass of one crosses as a value of its base type.
_PLAIN_BASES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, range)


_BASE_ITER: dict[type, Callable[[Any], Any]] = {list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__,
                                                frozenset: frozenset.__iter__}


def _plain_base(kind: type) -> type | None:
    for base in _PLAIN_BASES:
        if base in kind.__mro__:
            return base
    return None


def _dump(value: Any, out: bytearray, handle_of: Callable[[Any], tuple[int, str]] | None, depth: int) -> None:
    # Read through the base type's own methods, so a subclass's overrides (its __eq__, items(), __len__...)
    # never decide what crosses: the receiver gets the data, as a plain base-type value.
    base = None if value is None else _plain_base(type(value))
    if value is None:
        out += b"N"
    elif base is bool:
        out += b"T" if value else b"F"
    elif base is int:
        raw = int.to_bytes(value, (int.bit_length(value) + 8) // 8, "little", signed=True)
        out += b"i" + _LEN.pack(len(raw)) + raw
    elif base is float:
        out += b"f" + _F64.pack(value)
    elif base is complex:
        out += b"c" + _C128.pack(complex.__complex__(value).real, complex.__complex__(value).imag)
    elif base is str:
        raw = str.encode(value, "utf-8", "surrogatepass")
        out += b"s" + _LEN.pack(len(raw)) + raw
    elif base is bytes or base is bytearray:
        raw = bytes(memoryview(value))
        out += (b"b" if base is bytes else b"y") + _LEN.pack(len(raw)) + raw
    elif base is range:
        out += b"r"
        for bound in (value.start, value.stop, value.step):
            _dump(bound, out, handle_of, depth + 1)
    elif base is not None and depth < MAX_DEPTH:
        items = list(dict.items(value)) if base is dict else list(_BASE_ITER[base](value))
        out += _CONTAINER_TAGS[base] + _LEN.pack(len(items))
        for item in items:
            if base is dict:
                _dump(item[0], out, handle_of, depth + 1)
                _dump(item[1], out, handle_of, depth + 1)
            else:
                _dump(item, out, handle_of, depth + 1)
    elif handle_of is not None:
        ident, type_name = handle_of(value)
        raw = type_name.encode("utf-8", "replace")[:200]
        out += b"H" + _LEN.pack(ident) + _LEN.pack(len(raw)) + raw
    else:
        raise TypeError(f"a {type(value).__name__} cannot cross to the other process (only plain values can)")


def loads(data: bytes, make_handle: Callable[[int, str], Any] | None = None) -> Any:
    """Decode one value from ``data`` (all of it); :class:`WireError` for anything malformed."""
    reader = _Reader(data, make_handle or Handle)
    try:
        value = reader.value(0)
    except (IndexError, UnicodeDecodeError, TypeError, struct.error, RecursionError, OverflowError,
            ValueError) as exc:
        raise WireError(f"malformed message: {type(exc).__name__}: {exc}") from None
    if reader.pos != len(data):
        raise WireError(f"{len(data) - reader.pos} bytes after the message")
    return value


class _Reader:
    def __init__(self, data: bytes, make_handle: Callable[[int, str], Any]) -> None:
        self.data, self.pos, self.make_handle = data, 0, make_handle

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise WireError("message cut short")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def length(self) -> int:
        return int(_LEN.unpack(self.take(4))[0])

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"nested deeper than {MAX_DEPTH}")
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            return int.from_bytes(self.take(self.length()), "little", signed=True)
        if tag == b"f":
            return _F64.unpack(self.take(8))[0]
        if tag == b"c":
            real, imag = _C128.unpack(self.take(16))
            return complex(real, imag)
        if tag == b"s":
            return self.take(self.length()).decode("utf-8", "surrogatepass")
        if tag == b"b":
            return self.take(self.length())
        if tag == b"y":
            return bytearray(self.take(self.length()))
        if tag in (b"l", b"t", b"S", b"z"):
            count = self.length()
            items = [self.value(depth + 1) for _ in range(count)]
            return {b"l": list, b"t": tuple, b"S": set, b"z": frozenset}[tag](items)
        if tag == b"d":
            count = self.length()
            out = {}
            for _ in range(count):
                key = self.value(depth + 1)
                out[key] = self.value(depth + 1)
            return out
        if tag == b"r":
            bounds = [self.value(depth + 1) for _ in range(3)]
            if any(type(b) is not int for b in bounds):
                raise WireError("a range of non-integers")
            return range(*bounds)
        if tag == b"H":
            ident = self.length()
            return self.make_handle(ident, self.take(self.length()).decode("utf-8", "replace"))
        raise WireError(f"unknown tag {tag!r}")


def write_frame(fd: int, payload: bytes) -> None:
    """Write one frame (4-byte length, then the payload) to ``fd``."""
    data = memoryview(_LEN.pack(len(payload)) + payload)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def read_frame(fd: int, max_bytes: int) -> bytes:
    """Read one frame from ``fd``: :class:`ChannelClosed` at end of file, :class:`WireError` when it
    announces more than ``max_bytes``."""
    size = int(_LEN.unpack(_read_exactly(fd, 4))[0])
    if size > max_bytes:
        raise WireError(f"a {size}-byte message is over the {max_bytes}-byte limit")
    return _read_exactly(fd, size)


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed(f"the channel closed with {left} of {n} bytes to read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
