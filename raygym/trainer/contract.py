"""The records that cross the trainer-backend boundary, typed: what ``compute_log_probs`` returns
(:class:`LogProbResult`) and the metrics of a train step (:data:`TrainMetrics`); what a checkpoint holds of one
rank is :class:`raygym.checkpoint.state.CheckpointState`. Both backends (torch and Megatron) return exactly these.

>>> import torch
>>> result = LogProbResult(log_probs=[torch.zeros(2)])
>>> sorted(result), "ref_log_probs" in result
(['log_probs'], False)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TypedDict

import torch


@dataclass
class LogProbResult(Mapping[str, list[torch.Tensor]]):
    """Per-sample 1-D float32 CPU tensors (one value per response token) for EVERY sample of the batch.

    ``log_probs``: the policy's; ``ref_log_probs``: the reference model's, present when the trainer has
    one (``use_kl_loss`` or ``kl_coef``); ``entropy`` when asked; ``values``: a critic's.

    A read-only mapping of the fields that are set, so ``TrainBatch.with_log_probs(result)`` and
    ``result["log_probs"]`` work as they do on a dict.
    """

    log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    entropy: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None  # type: ignore[assignment]  # a field, shadowing Mapping.values()

    def _present(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> list[torch.Tensor]:
        value = getattr(self, key, None) if key in {f.name for f in fields(self)} else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())


# Keys every policy train step reports (prefix "train/"); dual_clipfrac, kl_loss and tis_* are added
# when their feature is on (raygym.algo.RLLossConfig.metric_names), adv_* when the batch has trained tokens.
TrainMetrics = TypedDict(
    "TrainMetrics",
    {
        "train/loss": float,
        "train/pg_loss": float,
        "train/entropy": float,
        "train/clipfrac": float,
        "train/approx_kl": float,
        "train/dual_clipfrac": float,
        "train/kl_loss": float,
        "train/tis_weight": float,
        "train/tis_clipped_frac": float,
        "train/tis_masked_frac": float,
        "train/grad_norm": float,
        "train/lr": float,
        "train/optimizer_steps": float,
        "train/adv_mean": float,
        "train/adv_std": float,
        "train/adv_min": float,
        "train/adv_max": float,
        "perf/train_tokens": float,
        "perf/train_step_time": float,
        "perf/train_tokens_per_s": float,
    },
    total=False,
)

ALWAYS_REPORTED = (
    "train/loss", "train/pg_loss", "train/entropy", "train/clipfrac", "train/approx_kl", "train/grad_norm",
    "train/lr", "train/optimizer_steps", "perf/train_tokens", "perf/train_step_time", "perf/train_tokens_per_s",
)


def step_metrics_summary(
    per_step: list[dict[str, float]],
    grad_norms: list[float],
    lrs: list[float],
    *,
    prefix: str,
    tokens: float,
    seconds: float,
) -> dict[str, float]:
    """A rollout's metrics from its optimizer steps': loss metrics and grad norms averaged over the steps,
    the last step's lr, the step count and the throughput, as ``"<prefix>/<name>"`` / ``"perf/<prefix>_*"``.

    >>> step_metrics_summary([{"pg_loss": 1.0}, {"pg_loss": 3.0}], [2.0, 4.0], [0.1, 0.2],
    ...                      prefix="train", tokens=10.0, seconds=2.0)["train/pg_loss"]
    2.0
    """
    n = len(per_step)
    out: dict[str, float] = {}
    for step in per_step:
        for name, value in step.items():
            out[f"{prefix}/{name}"] = out.get(f"{prefix}/{name}", 0.0) + value / n
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out[f"{prefix}/lr"] = lrs[-1]
    out[f"{prefix}/optimizer_steps"] = float(n)
    out[f"perf/{prefix}_tokens"] = tokens
    out[f"perf/{prefix}_step_time"] = seconds
    out[f"perf/{prefix}_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return out


def advantage_stats(advantages: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> dict[str, float]:
    """Mean / std (population) / min / max of the advantages over the trained tokens of a batch.

    >>> advantage_stats([torch.tensor([1.0, 3.0])], [torch.tensor([1.0, 1.0])])["train/adv_mean"]
    2.0
    """
    vals = [a.float()[m > 0] for a, m in zip(advantages, loss_masks, strict=True)]
    flat = torch.cat(vals) if vals else torch.zeros(0)
    if flat.numel() == 0:
        return {}
    return {
        "train/adv_mean": float(flat.mean()),
        "train/adv_std": float(flat.std(unbiased=False)),
        "train/adv_min": float(flat.min()),
        "train/adv_max": float(flat.max()),
    }
