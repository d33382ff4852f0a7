"""Trainer-engine log-prob mismatch: how far the engine's log-probs of its sampled tokens are from the
trainer's for the same tokens under the same weights (pure torch).

Every engine kind reports per-token log-probs with its samples (``Sample.rollout_log_probs``); the trainer
computes its own (the old log-probs of the policy loss). Their absolute difference, over the trained
tokens, is what decides whether truncated importance sampling (``use_tis``) is needed: different kernels,
dtypes (a bf16 engine, an fp32 trainer) and sampling code make it nonzero even with identical weights.
Logged per step as ``rollout/logprob_mismatch_mean`` and ``rollout/logprob_mismatch_max``.

>>> import torch
>>> tally = MismatchTally()
>>> tally.add(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.1, -2.0, -9.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
>>> {k: round(v, 3) for k, v in tally.metrics().items()}
{'rollout/logprob_mismatch_mean': 0.05, 'rollout/logprob_mismatch_max': 0.1}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raygym.trainer.batch import TrainBatch

MEAN, MAX = "rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max"


class MismatchTally:
    """Sum, count and maximum of ``|engine - trainer|`` over masked tokens, accumulated over micro-batches
    (and, with :meth:`all_reduce`, over data-parallel ranks)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0.0
        self.max = 0.0

    def add(self, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> None:
        """Padded ``[b, T]`` log-probs of the engine and the trainer, and the ``[b, T]`` loss mask."""
        keep = mask.detach().float() > 0
        if not bool(keep.any()):
            return
        diff = (engine.detach().float() - trainer.detach().float()).abs()[keep]
        self.total += float(diff.sum())
        self.count += float(diff.numel())
        self.max = max(self.max, float(diff.max()))

    def add_rows(self, engine: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor]) -> None:
        """Per-sample 1-D rows (a ``TrainBatch``'s ``rollout_log_probs``, ``old_log_probs``, ``loss_masks``)."""
        for e, t, m in zip(engine, trainer, masks, strict=True):
            self.add(e[None], t[None], m[None])

    def all_reduce(self, device: torch.device | str = "cpu", group: object = None) -> None:
        """Combine the tallies of every rank of ``group`` (torch.distributed must be initialised; ``device``:
        where the group's backend reduces, cuda for NCCL)."""
        import torch.distributed as dist

        sums = torch.tensor([self.total, self.count], dtype=torch.float64, device=device)
        peak = torch.tensor([self.max], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        self.total, self.count, self.max = float(sums[0]), float(sums[1]), float(peak[0])

    def metrics(self) -> dict[str, float]:
        """The two metrics; empty when no token was compared."""
        if self.count == 0:
            return {}
        return {MEAN: self.total / self.count, MAX: self.max}


def batch_mismatch(batch: TrainBatch) -> dict[str, float]:
    """The metrics of a ``TrainBatch`` that carries both rollout and old log-probs (else ``{}``)."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        return {}
    tally = MismatchTally()
    tally.add_rows(batch.rollout_log_probs, batch.old_log_probs, batch.loss_masks)
    return tally.metrics()


def mismatch_by_age(batch: TrainBatch, token_ages: Sequence[Sequence[int]], max_age: int) -> dict[str, float]:
    """The mismatch split by how many policy versions old each token is when trained (``token_ages``: per
    sample, per response token; fully asynchronous runs): ``rollout/logprob_mismatch_mean/staleness_<k>`` and
    ``_max/staleness_<k>`` for every age ``k`` seen (ages above ``max_age`` fold into ``max_age``)."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        return {}
    tallies: dict[int, MismatchTally] = {}
    for engine, trainer, mask, ages in zip(batch.rollout_log_probs, batch.old_log_probs, batch.loss_masks,
                                           token_ages, strict=True):
        age = torch.tensor([min(a, max_age) for a in ages], dtype=torch.int64)
        for k in sorted(set(age.tolist())):
            tallies.setdefault(k, MismatchTally()).add(engine[None], trainer[None], (mask * (age == k))[None])
    out: dict[str, float] = {}
    for k, tally in sorted(tallies.items()):
        for name, value in tally.metrics().items():
            out[f"{name}/staleness_{k}"] = value
    return out
