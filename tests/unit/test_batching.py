"""Micro-batch packing, rank balancing and optimizer-step planning."""

from __future__ import annotations

import random

import pytest

from raygym.algo import (
    balance_across_ranks,
    contiguous_shard,
    fixed_micro_batches,
    num_optimizer_steps,
    optimizer_step_slices,
    pack_micro_batches,
    padded_micro_batches,
)
from raygym.errors import ConfigError


def test_packing_hand_case():
    assert pack_micro_batches([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]
    assert pack_micro_batches([20, 1, 1], 8) == [[0], [1, 2]]  # an oversized sample goes alone


@pytest.mark.parametrize("seed", range(5))
def test_packing_properties(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 60))]
    budget = 512
    bins = pack_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= budget or len(b) == 1
    # first-fit-decreasing never needs more than 11/9 OPT + 1 bins; OPT >= total / budget
    assert len(bins) <= 11 / 9 * (sum(lengths) / budget) + 2
    assert pack_micro_batches(lengths, budget) == bins  # deterministic


@pytest.mark.parametrize("seed", range(5))
def test_padded_plan_keeps_every_padded_micro_batch_in_budget_and_pads_less_than_first_fit(seed):
    rng = random.Random(seed)
    # a long tail: most samples short, a few long (what an RL batch looks like)
    lengths = [rng.choice([rng.randrange(8, 16)] * 7 + [rng.randrange(40, 80)]) for _ in range(128)]
    budget = 1024

    def padded(bins):
        return sum(len(b) * max(lengths[i] for i in b) for b in bins)

    bins = padded_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1 for b in bins)
    assert all(b == sorted(b) for b in bins) and padded_micro_batches(lengths, budget) == bins
    assert padded(bins) <= 1.25 * sum(lengths)  # like lengths train together: little padding
    assert padded(bins) < padded(pack_micro_batches(lengths, budget))
    with pytest.raises(ConfigError, match="max_tokens_per_gpu=0"):
        padded_micro_batches(lengths, 0)


def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ConfigError, match="micro_batch_size"):
        fixed_micro_batches(5, 0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_balance_equal_counts_and_tokens(world):
    rng = random.Random(world)
    lengths = [rng.randrange(1, 1000) for _ in range(8 * world)]
    ranks = balance_across_ranks(lengths, world)
    assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
    assert all(len(r) == 8 for r in ranks)
    totals = [sum(lengths[i] for i in r) for r in ranks]
    naive = [sum(lengths[i] for i in contiguous_shard(len(lengths), k, world)) for k in range(world)]
    assert max(totals) - min(totals) <= max(max(naive) - min(naive), max(lengths))


def test_balance_rejects_uneven_split():
    with pytest.raises(ConfigError, match="global_batch_size"):
        balance_across_ranks([1, 2, 3], 2)


def test_contiguous_shard_covers_everything():
    assert [contiguous_shard(7, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]


def test_optimizer_steps():
    assert num_optimizer_steps(16 * 8, 32) == 4
    assert optimizer_step_slices(6, 3) == [[0, 1, 2], [3, 4, 5]]
    for bad in ((10, 4), (2, 4), (8, 0)):
        with pytest.raises(ConfigError, match="global_batch_size"):
            num_optimizer_steps(*bad)
