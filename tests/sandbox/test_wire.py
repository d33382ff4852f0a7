"""The grader/candidate wire format: plain values round-trip, anything else is a handle or refused, and
hostile bytes give WireError (never another exception, never a non-plain object)."""

from __future__ import annotations

import os
import random

import pytest

from raygym.sandbox import wire

PLAIN = [None, True, False, 0, -1, 2**200, -(2**70) + 3, 1.5, float("inf"), -0.0, 3 + 4j, "", "héllo ✓ \U0001F600",
         "\udc80", b"", b"\x00\xff", bytearray(b"ab"), [], [1, [2, [3]]], (), (1, "a", None), {"a": 1, 2: [3], (4, 5): {}},
         set(), {1, "x", (2, 3)}, frozenset({1, 2}), {frozenset({1}): (b"k",)}, range(-3, 10**30, 7)]
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, range,
               wire.Handle)


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_round_trip_with_their_exact_type(value):
    back = wire.loads(wire.dumps(value))
    assert back == value and type(back) is type(value)


def test_subclasses_cross_as_their_base_values_and_objects_as_handles():
    from collections import Counter, OrderedDict, namedtuple

    class Lies(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    class Hides(dict):
        def items(self):
            return [("forged", 1)]

        def __len__(self):
            return 0

    point = namedtuple("point", "x y")
    sent = [Lies(5), Hides(a=1), Counter("aab"), OrderedDict(b=2), point(1, 2), range(1, 9, 2)]
    back = wire.loads(wire.dumps(sent))
    assert back == [5, {"a": 1}, {"a": 2, "b": 1}, {"b": 2}, (1, 2), range(1, 9, 2)]
    assert [type(v) for v in back] == [int, dict, dict, dict, tuple, range]  # the overrides stayed behind
    assert back[0] != 0
    with pytest.raises(TypeError):
        wire.dumps([1, object()])
    seen = []
    data = wire.dumps([1, object, len], handle_of=lambda obj: (seen.append(obj) or len(seen) - 1, type(obj).__name__))
    one, cls, fn = wire.loads(data)
    assert one == 1 and (cls.id, cls.type_name) == (0, "type") and (fn.id, fn.type_name) == (1, "builtin_function_or_method")
    assert type(fn) is wire.Handle and fn != len  # the decoder never rebuilds an object


def test_nesting_past_the_depth_limit_is_a_handle_when_encoded_and_an_error_when_decoded():
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    data = wire.dumps(deep, handle_of=lambda obj: (7, type(obj).__name__))
    assert b"H" in data  # what is nested deeper than the limit crossed as a handle
    forged = b"l\x01\x00\x00\x00" * (wire.MAX_DEPTH + 2) + b"N"
    with pytest.raises(wire.WireError):
        wire.loads(forged)


def all_plain(value) -> bool:
    if not isinstance(value, PLAIN_TYPES) or type(value).__module__ not in ("builtins", wire.__name__):
        return False
    if isinstance(value, dict):
        return all(all_plain(k) and all_plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(all_plain(v) for v in value)
    return True


def test_hostile_bytes_give_wire_errors_or_plain_values():
    rng = random.Random(0)
    valid = [wire.dumps(v) for v in PLAIN]
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(3000)]
    samples += [data[:cut] for data in valid for cut in range(len(data))]  # every truncation
    samples += [bytes(rng.choice(b"NTFifcsbylSztdrH\x00\x01\xff") for _ in range(rng.randrange(30))) for _ in range(3000)]
    samples += [b"d\x02\x00\x00\x00lNNNN", b"S\x01\x00\x00\x00l\x00\x00\x00\x00", b"s\x02\x00\x00\x00\xff\xfe",
                b"l\xff\xff\xff\xff", b"i\xff\xff\xff\x7f\x01", b"NN"]  # unhashable key, bad utf-8, huge counts, trailing bytes
    errors = 0
    for data in samples:
        try:
            value = wire.loads(data)
        except wire.WireError:
            errors += 1
            continue
        assert all_plain(value), (data, value)
    assert errors > len(samples) // 2


def test_frames_are_bounded_and_end_cleanly():
    read_fd, write_fd = os.pipe()
    try:
        wire.write_frame(write_fd, b"abc")
        assert wire.read_frame(read_fd, 10) == b"abc"
        wire.write_frame(write_fd, b"x" * 11)
        with pytest.raises(wire.WireError):
            wire.read_frame(read_fd, 10)  # refused from its header, before reading the body
        os.close(write_fd)
        write_fd = -1
        os.read(read_fd, 11)
        with pytest.raises(wire.ChannelClosed):
            wire.read_frame(read_fd, 10)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
