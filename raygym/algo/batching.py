"""Splitting a rollout batch into optimizer steps, data-parallel ranks and micro-batches (pure Python).

Every function returns lists of sample indices, so the trainer never copies data to plan.

>>> pack_micro_batches([5, 3, 4, 2], max_tokens=7)
[[0, 3], [1, 2]]
>>> balance_across_ranks([9, 1, 8, 2], world=2)
[[0, 1], [2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence

from raygym.errors import ConfigError


def pack_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing packing of samples into micro-batches of at most ``max_tokens`` tokens.

    The budget counts real tokens (sum of lengths). A sample longer than ``max_tokens`` gets a
    micro-batch of its own. Deterministic: bins keep creation order, indices inside a bin ascend.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens_per_gpu={max_tokens}: must be a positive token budget, e.g. 8192")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def padded_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches for a trainer that pads each micro-batch to its longest sample (the torch backend's HF
    forward): the samples, sorted longest first, are cut into consecutive runs whose *padded* size (samples x
    the longest) stays within ``max_tokens``, choosing the cut of least padded tokens plus ``max_tokens / 8``
    per micro-batch (a micro-batch of its own is worth it when it saves more padding than that; dynamic
    programming over the sorted order). Samples of like length train together, so a
    long tail of short answers is not padded to the longest one, as it is when first-fit by real tokens
    (:func:`pack_micro_batches`) puts short samples beside long ones. A sample longer than ``max_tokens`` goes
    alone. Deterministic; indices ascend inside each micro-batch.

    >>> padded_micro_batches([5, 3, 4, 2], max_tokens=8), padded_micro_batches([2, 9, 2, 2], max_tokens=6)
    ([[0], [2], [1, 3]], [[1], [0, 2, 3]])
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens_per_gpu={max_tokens}: must be a positive token budget, e.g. 8192")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    longest = [lengths[i] for i in order]
    overhead = max(1, max_tokens // 8)
    # best[j]: (cost, micro-batches) of the best cut of order[:j]; start[j]: where its last run starts
    best: list[tuple[int, int]] = [(0, 0)] + [(2**62, 0)] * len(order)
    start = [0] * (len(order) + 1)
    for i in range(len(order)):
        for j in range(i + 1, len(order) + 1):
            padded = (j - i) * longest[i]
            if padded > max_tokens and j > i + 1:
                break
            cost = (best[i][0] + padded + overhead, best[i][1] + 1)
            if cost < best[j]:
                best[j], start[j] = cost, i
    bins: list[list[int]] = []
    j = len(order)
    while j > 0:
        bins.append(sorted(order[start[j]:j]))
        j = start[j]
    return bins[::-1]


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size={micro_batch_size}: must be >= 1")
    return [
        list(range(s, min(s + micro_batch_size, num_samples)))
        for s in range(0, num_samples, micro_batch_size)
    ]


def balance_across_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Split samples over ``world`` ranks: equal sample counts, token totals balanced greedily.

    Longest samples first, each to the rank with the fewest tokens that still has room. Needs
    ``len(lengths)`` to be a multiple of ``world``. Indices inside a rank ascend.
    """
    if world < 1 or len(lengths) % world != 0:
        raise ConfigError(
            f"global_batch_size: {len(lengths)} samples cannot be split evenly over {world} data-parallel ranks; "
            "make global_batch_size a multiple of the number of trainer GPUs"
        )
    per_rank = len(lengths) // world
    ranks: list[list[int]] = [[] for _ in range(world)]
    totals = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_ranks = [r for r in range(world) if len(ranks[r]) < per_rank]
        r = min(open_ranks, key=lambda r: (totals[r], r))
        ranks[r].append(i)
        totals[r] += lengths[i]
    return [sorted(r) for r in ranks]


def contiguous_shard(num_samples: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s share of ``num_samples`` in order; shares differ by at most one sample."""
    base, extra = divmod(num_samples, world)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def num_optimizer_steps(num_samples: int, global_batch_size: int) -> int:
    """Optimizer steps for one rollout batch; each step sees exactly ``global_batch_size`` samples.

    ``num_samples`` is rollout_batch_size * n_samples_per_prompt (after any filtering).
    """
    if global_batch_size < 1 or num_samples < global_batch_size or num_samples % global_batch_size != 0:
        raise ConfigError(
            f"global_batch_size={global_batch_size}: a rollout batch of {num_samples} samples must be a positive "
            "multiple of it; set global_batch_size to a divisor of rollout_batch_size * n_samples_per_prompt"
        )
    return num_samples // global_batch_size


def optimizer_step_slices(num_samples: int, global_batch_size: int) -> list[list[int]]:
    """Sample indices of each optimizer step: consecutive blocks of ``global_batch_size``."""
    steps = num_optimizer_steps(num_samples, global_batch_size)
    return [list(range(k * global_batch_size, (k + 1) * global_batch_size)) for k in range(steps)]
