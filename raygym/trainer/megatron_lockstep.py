"""Expert parallelism in lock step: the ranks of an expert-parallel group exchange tokens inside every MoE layer,
so each must run the same forward (and backward) passes, and with the all-gather dispatcher (the CPU mode's) over
rows of the same length. Each rank plans its own micro-batches; :func:`lockstep_plan` agrees on as many passes as
the busiest rank has and on the longest row of each, and a rank without a micro-batch for a pass runs a padding
row (``None`` in the plan). Dense data parallelism needs none of this (its ranks meet only in the gradient sum).

>>> lockstep_plan([[0, 1], [2]], [3, 4, 5], ep_size=1)
[([0, 1], None), ([2], None)]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """Element-wise maximum of every rank's ``values`` (missing entries count as 0); a collective over the world."""
    import torch.distributed as dist

    count = torch.tensor([len(values)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    padded = torch.zeros(int(count.item()), dtype=torch.int64)
    padded[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(padded, op=dist.ReduceOp.MAX)
    return [int(v) for v in padded.tolist()]


def lockstep_plan(micro_batches: list[list[int]], lengths: Sequence[int], *, ep_size: int
                  ) -> list[tuple[list[int] | None, int | None]]:
    """Per forward pass: (this rank's micro-batch, as positions into ``lengths``, or None for a padding row; the
    packed row length every rank uses, or None = its own) — a collective when ``ep_size > 1``."""
    if ep_size == 1:
        return [(mb, None) for mb in micro_batches]
    rows = max_over_ranks([sum(lengths[j] for j in mb) for mb in micro_batches])
    return [(micro_batches[k] if k < len(micro_batches) else None, max(row, 1)) for k, row in enumerate(rows)]
