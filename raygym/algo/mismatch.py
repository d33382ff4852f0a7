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

import torch

MEAN, MAX = "rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max"


class MismatchTally:
    """Sum, count and maximum of ``|engine - trainer|`` over masked tokens, accumulated over micro-batches
    (and, with :meth:`all_reduce`, over data-parallel ranks). With ``ages`` > 0 it also keeps one tally per
    token age 0 .. ``ages - 1`` (how many policy versions older than the trainer the token's engine was; fully
    asynchronous runs), reported as ``<metric>/staleness_<k>``.

    >>> t = MismatchTally(ages=2)
    >>> t.add(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2), torch.tensor([[1, 0]]))
    >>> t.metrics()["rollout/logprob_mismatch_mean/staleness_1"], t.metrics()["rollout/logprob_mismatch_mean/staleness_0"]
    (0.5, 0.0)
    """

    def __init__(self, ages: int = 0) -> None:
        self.ages = ages
        self.total = 0.0
        self.count = 0.0
        self.max = 0.0
        self.by_age = torch.zeros(ages, 3, dtype=torch.float64)  # per age: total, count, max

    def add(self, engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
            ages: torch.Tensor | None = None) -> None:
        """Padded ``[b, T]`` log-probs of the engine and the trainer, the ``[b, T]`` loss mask and, when the
        tally keeps ages, the ``[b, T]`` age of each token (ages past the last fold into it)."""
        keep = mask.detach().float() > 0
        if not bool(keep.any()):
            return
        diff_all = (engine.detach().float() - trainer.detach().float()).abs()
        diff = diff_all[keep]
        self.total += float(diff.sum())
        self.count += float(diff.numel())
        self.max = max(self.max, float(diff.max()))
        if self.ages and ages is not None:
            folded = ages.to(diff_all.device).clamp(0, self.ages - 1)
            for k in range(self.ages):
                part = diff_all[keep & (folded == k)]
                if part.numel():
                    row = self.by_age[k]
                    row[0] += float(part.sum())
                    row[1] += float(part.numel())
                    row[2] = max(float(row[2]), float(part.max()))

    def add_rows(self, engine: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor], ages: Sequence[torch.Tensor] | None = None) -> None:
        """Per-sample 1-D rows (a ``TrainBatch``'s ``rollout_log_probs``, ``old_log_probs``, ``loss_masks`` and
        ``token_ages``)."""
        for i, (e, t, m) in enumerate(zip(engine, trainer, masks, strict=True)):
            self.add(e[None], t[None], m[None], None if ages is None else ages[i][None])

    def all_reduce(self, device: torch.device | str = "cpu", group: object = None) -> None:
        """Combine the tallies of every rank of ``group`` (torch.distributed must be initialised; ``device``:
        where the group's backend reduces, cuda for NCCL)."""
        import torch.distributed as dist

        sums = torch.cat([torch.tensor([self.total, self.count], dtype=torch.float64),
                          self.by_age[:, :2].reshape(-1)]).to(device)
        peaks = torch.cat([torch.tensor([self.max], dtype=torch.float64), self.by_age[:, 2]]).to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
        sums, peaks = sums.cpu(), peaks.cpu()
        self.total, self.count, self.max = float(sums[0]), float(sums[1]), float(peaks[0])
        if self.ages:
            self.by_age[:, :2] = sums[2:].reshape(self.ages, 2)
            self.by_age[:, 2] = peaks[1:]

    def metrics(self) -> dict[str, float]:
        """The two metrics (and per age, where tokens of that age were seen); empty when no token was
        compared."""
        if self.count == 0:
            return {}
        out = {MEAN: self.total / self.count, MAX: self.max}
        for k in range(self.ages):
            total, count, peak = (float(v) for v in self.by_age[k])
            if count:
                out[f"{MEAN}/staleness_{k}"] = total / count
                out[f"{MAX}/staleness_{k}"] = peak
        return out
