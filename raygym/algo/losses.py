"""Policy, KL, entropy and value losses with exact global aggregation.

Inputs are padded ``[B, T]`` tensors (B samples of one micro-batch, T response positions) with a float
``loss_mask`` that is 0 on padding and on tokens the policy did not produce.

Aggregation (``aggregate``):
- per sample (default): token mean within each sample, then sum over samples / ``num_samples``;
- per token (``per_token=True``): masked sum / ``num_tokens``.
``num_samples`` / ``num_tokens`` are the GLOBAL denominators of one optimizer step (all micro-batches,
all ranks). Pass them and the per-micro-batch losses add up to the full-batch loss exactly, so gradient
accumulation reproduces one big batch. Left as None they default to this micro-batch's own counts.
A sample with an all-zero mask contributes 0 but still counts in ``num_samples``.

>>> import torch
>>> lp = torch.zeros(1, 2); mask = torch.ones(1, 2)
>>> loss, m = policy_loss(lp, lp, torch.tensor([1.0]), mask, eps_clip=0.2, eps_clip_high=0.28)
>>> float(loss), float(m["clipfrac"])
(-1.0, 0.0)
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict

import torch

from raygym.algo.kl import kl_penalty
from raygym.errors import ConfigError


class Aggregation(TypedDict):
    """``aggregate``'s keyword options, passed along as ``**agg`` by the losses built on it."""

    per_token: bool
    num_samples: int | float | None
    num_tokens: int | float | None


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    per_token: bool = False,
    num_samples: int | float | None = None,
    num_tokens: int | float | None = None,
) -> torch.Tensor:
    """Masked scalar aggregation of ``[B, T]`` per-token ``values`` (see the module docstring)."""
    mask = loss_mask.to(values.dtype)
    masked = values * mask
    if per_token:
        denom = mask.sum() if num_tokens is None else torch.as_tensor(float(num_tokens), device=values.device)
        return masked.sum() / denom.clamp(min=1.0)
    per_sample = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    sample_count = values.shape[0] if num_samples is None else num_samples
    return per_sample.sum() / max(float(sample_count), 1.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, computed stably as ``logsumexp - E[logit]``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip: float) -> torch.Tensor:
    """Truncated importance weights ``clamp(exp(old - rollout), 0, clip)`` for the train/inference mismatch."""
    return importance_weights(old_log_probs, rollout_log_probs, torch.ones_like(old_log_probs), clip=clip).weights


TIS_MODES = ("truncate", "mask")
TIS_LEVELS = ("token", "sequence", "geometric")


class ImportanceWeights(NamedTuple):
    """Detached ``[B, T]`` off-policy weights and, per token, 1.0 where the weight was truncated
    (``clipped``, truncate mode) or set to 0 (``masked``, mask mode)."""

    weights: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip: float,
    clip_low: float = 0.0,
    mode: str = "truncate",
    level: str = "token",
) -> ImportanceWeights:
    """Importance weights of the old (trainer) policy against the policy that generated the rollout.

    The ratio is ``exp(old - rollout)`` per token (``level="token"``), ``exp`` of the sum of those log
    ratios over the sample's loss tokens (``"sequence"``) or of their mean (``"geometric"``); a sample's
    ratio applies to each of its tokens. ``mode="truncate"`` (TIS) clamps it into ``[clip_low, clip]``;
    ``mode="mask"`` (MIS; IcePop at token level) keeps it where ``clip_low <= ratio <= clip`` and
    gives 0 elsewhere, so those tokens (or whole samples) add nothing to the loss.

    >>> old = torch.tensor([[0.0, 0.0, 0.0]]); rollout = torch.tensor([[0.0, 1.0, -1.0]])
    >>> w = importance_weights(old, rollout, torch.ones(1, 3), clip=2.0, clip_low=0.5)
    >>> [round(x, 4) for x in w.weights[0].tolist()], w.clipped[0].tolist()
    ([1.0, 0.5, 2.0], [0.0, 1.0, 1.0])
    >>> importance_weights(old, rollout, torch.ones(1, 3), clip=2.0, clip_low=0.5, mode="mask").masked[0].tolist()
    [0.0, 1.0, 1.0]
    """
    if mode not in TIS_MODES:
        raise ConfigError(f"tis_mode={mode!r}: use 'truncate' (TIS) or 'mask' (MIS / IcePop)")
    if level not in TIS_LEVELS:
        raise ConfigError(f"tis_level={level!r}: use one of {', '.join(map(repr, TIS_LEVELS))}")
    on = loss_mask > 0
    log_ratio = torch.where(on, old_log_probs.float() - rollout_log_probs.float(), 0.0)
    if level != "token":
        total = log_ratio.sum(dim=-1, keepdim=True)
        if level == "geometric":
            total = total / on.sum(dim=-1, keepdim=True).clamp(min=1)
        log_ratio = total.expand_as(log_ratio)
    ratio = torch.exp(log_ratio).detach()
    outside = (ratio < clip_low) | (ratio > clip)
    none = torch.zeros_like(ratio)
    if mode == "truncate":
        return ImportanceWeights(ratio.clamp(clip_low, clip), outside.to(ratio.dtype), none)
    return ImportanceWeights(torch.where(outside, 0.0, ratio), none, outside.to(ratio.dtype))


def sequence_log_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO: per-sample mean log importance ratio over trained tokens, broadcast back to ``[B, T]``."""
    mask = loss_mask.to(log_probs.dtype)
    seq = ((log_probs - old_log_probs) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return seq.unsqueeze(-1).expand_as(log_probs)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    per_token: bool = False,
    eps_clip_c: float | None = None,
    tis_weights: torch.Tensor | None = None,
    ratio_level: str = "token",
    num_samples: int | float | None = None,
    num_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate ``max(-r*A, -clip(r, 1-eps_clip, 1+eps_clip_high)*A)`` per token, aggregated.

    ``advantages`` is ``[B]`` (one per sample) or ``[B, T]``. ``eps_clip_c`` (> 1) adds the dual clip for
    negative advantages: ``min(loss, -c*A)``. ``tis_weights`` ``[B, T]`` multiply the per-token loss.
    ``ratio_level="sequence"`` uses GSPO's sequence-level ratio (geometric mean over the sample's tokens).
    Returns ``(loss, metrics)``; metrics (``clipfrac``, ``approx_kl``, and ``dual_clipfrac`` when dual
    clipping) are detached and aggregated with the same denominators as the loss, so they too add up
    across micro-batches.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    advantages = advantages.to(log_probs.dtype)
    if ratio_level == "token":
        log_ratio = log_probs - old_log_probs
    elif ratio_level == "sequence":
        log_ratio = sequence_log_ratio(log_probs, old_log_probs, loss_mask)
    else:
        raise ConfigError(f"ratio_level={ratio_level!r}: use 'token' (PPO/GRPO) or 'sequence' (GSPO)")
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipped_flag = (clipped > unclipped).to(log_probs.dtype)
    agg: Aggregation = {"per_token": per_token, "num_samples": num_samples, "num_tokens": num_tokens}
    metrics: dict[str, torch.Tensor] = {}
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ConfigError(f"eps_clip_c={eps_clip_c}: the dual-clip bound must be > 1 (e.g. 3.0), or None")
        dual = -eps_clip_c * advantages
        dual_flag = ((advantages < 0) & (loss > dual)).to(log_probs.dtype)
        loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
        metrics["dual_clipfrac"] = aggregate(dual_flag, loss_mask, **agg).detach()
    if tis_weights is not None:
        loss = loss * tis_weights.to(loss.dtype)
    metrics["clipfrac"] = aggregate(clipped_flag, loss_mask, **agg).detach()
    metrics["approx_kl"] = aggregate((old_log_probs - log_probs).detach(), loss_mask, **agg)
    return aggregate(loss, loss_mask, **agg), metrics


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    kind: str,
    *,
    per_token: bool = False,
    num_samples: int | float | None = None,
    num_tokens: int | float | None = None,
) -> torch.Tensor:
    """Aggregated KL of the policy against the reference (``kl_loss_type``); multiply by ``kl_loss_coef``."""
    per_tok = kl_penalty(log_probs, ref_log_probs, kind)
    return aggregate(per_tok, loss_mask, per_token=per_token, num_samples=num_samples, num_tokens=num_tokens)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    value_clip: float | None = 0.2,
    per_token: bool = False,
    num_samples: int | float | None = None,
    num_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * max((v - R)^2, (v_clipped - R)^2)``, v clipped to ``old +- value_clip``.

    ``value_clip=None`` gives the plain squared error. Metrics: ``value_clipfrac``.
    """
    err = (values - returns).square()
    agg: Aggregation = {"per_token": per_token, "num_samples": num_samples, "num_tokens": num_tokens}
    if value_clip is None:
        return aggregate(0.5 * err, loss_mask, **agg), {}
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped_err = (clipped_values - returns).square()
    flag = (clipped_err > err).to(values.dtype)
    loss = 0.5 * torch.maximum(err, clipped_err)
    return aggregate(loss, loss_mask, **agg), {"value_clipfrac": aggregate(flag, loss_mask, **agg).detach()}
