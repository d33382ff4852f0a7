"""Bucket planning: order preserved, size bound respected, oversized tensors alone."""

from __future__ import annotations

import random

import pytest

from raygym.errors import ConfigError
from raygym.weightsync.buckets import BucketPlanner, TensorMeta, iter_buckets, plan_buckets


def metas(sizes: list[int]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", (s,), "uint8", s) for i, s in enumerate(sizes)]


def test_order_and_bound_on_random_streams():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(0, 300) for _ in range(rng.randint(0, 40))]
        limit = rng.randint(1, 400)
        buckets = plan_buckets(metas(sizes), limit)
        flat = [m.name for b in buckets for m in b.metas]
        assert flat == [f"t{i}" for i in range(len(sizes))]
        for b in buckets:
            assert b.nbytes == sum(m.nbytes for m in b.metas)
            assert b.nbytes <= limit or len(b.metas) == 1
        # greedy: a bucket is closed only because the next tensor would not fit
        for a, b in zip(buckets, buckets[1:], strict=False):
            assert a.nbytes + b.metas[0].nbytes > limit


def test_oversized_tensor_travels_alone():
    buckets = plan_buckets(metas([10, 500, 10, 10]), 100)
    assert [[m.name for m in b.metas] for b in buckets] == [["t0"], ["t1"], ["t2", "t3"]]
    assert buckets[1].nbytes == 500


def test_accepts_plain_tuples_and_empty_input():
    assert plan_buckets([], 10) == []
    (bucket,) = plan_buckets([("w", (2, 2), "float32", 16)], 64)
    assert bucket.metas[0] == TensorMeta("w", (2, 2), "float32", 16)


def test_streaming_planner_matches_plan():
    sizes = [5, 7, 3, 9, 1, 12, 4]
    planner = BucketPlanner(12)
    out = [b for m in metas(sizes) if (b := planner.add(m)) is not None]
    last = planner.finish()
    out += [last] if last else []
    assert [b.nbytes for b in out] == [b.nbytes for b in iter_buckets(metas(sizes), 12)] == [12, 12, 1, 12, 4]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_buffer_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="update_weight_buffer_size"):
        plan_buckets(metas([1]), bad)
