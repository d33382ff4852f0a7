"""Advantage estimators: GRPO family (group-relative), REINFORCE++ family and PPO (GAE).

All tensors are torch and may live on any device. Samples of one group are contiguous:
sample ``i`` belongs to group ``i // group_size``.

>>> import torch
>>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, normalize_std=False)
tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from raygym.algo.kl import kl_penalty
from raygym.errors import ConfigError

ESTIMATORS = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


class AdvantageOutput(NamedTuple):
    """Per-sample 1-D tensors, one entry per response token."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: ``(r - group mean) / (group std + eps)``.

    ``rewards`` is ``[B]`` with ``B`` a multiple of ``group_size``; the std is unbiased (N-1). Groups of
    size 1 and ``normalize_std=False`` (Dr.GRPO) skip the std division; all-equal rewards give 0, not NaN.
    """
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ConfigError(
            f"n_samples_per_prompt={group_size}: the batch of {rewards.numel()} rewards is not a whole number "
            "of groups; make the number of samples a multiple of n_samples_per_prompt"
        )
    grouped = rewards.float().reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centred.reshape(-1)


def _token_kl(
    log_probs: list[torch.Tensor] | None, ref_log_probs: list[torch.Tensor] | None, n: int, kl_coef: float
) -> list[torch.Tensor] | None:
    if kl_coef == 0.0:
        return None
    if log_probs is None or ref_log_probs is None or len(log_probs) != n or len(ref_log_probs) != n:
        raise ConfigError(
            f"kl_coef={kl_coef}: a KL penalty in the reward needs log_probs and ref_log_probs for every sample; "
            "compute them with the reference model, or set kl_coef=0"
        )
    return [kl_penalty(lp, ref, "k1") for lp, ref in zip(log_probs, ref_log_probs, strict=True)]


def _last_trained_index(mask: torch.Tensor) -> int:
    """Where the sequence reward lands: the last policy-generated token (the last token if none)."""
    trained = torch.nonzero(mask > 0)
    return int(trained[-1]) if trained.numel() else mask.numel() - 1


def _token_rewards(
    rewards: torch.Tensor, masks: list[torch.Tensor], kl: list[torch.Tensor] | None, kl_coef: float
) -> list[torch.Tensor]:
    out = []
    for i, mask in enumerate(masks):
        r = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if kl is not None:
            r = r - kl_coef * kl[i].float() * mask
        if mask.numel():
            r[_last_trained_index(mask)] += rewards[i].float()
        out.append(r)
    return out


def _discounted_returns(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    for t in range(token_rewards.numel() - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        returns[t] = running
    return returns


def masked_whiten(
    values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8
) -> list[torch.Tensor]:
    """Batch whitening over every masked token of every sample: ``(x - mean) / sqrt(var + eps)``.

    Mean and (biased) variance are taken over the tokens whose mask is 1, across the whole batch.
    """
    flat = torch.cat([v.float() for v in values]) if values else torch.zeros(0)
    flat_mask = torch.cat([m.float() for m in masks]) if masks else torch.zeros(0)
    count = flat_mask.sum().clamp(min=1.0)
    mean = (flat * flat_mask).sum() / count
    var = ((flat - mean).square() * flat_mask).sum() / count
    scale = torch.rsqrt(var + eps)
    return [(v.float() - mean) * scale for v in values]


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for one response (value after the last token is 0).

    Untrained positions (mask 0) get value 0 and reward 0, as if absent. Returns (advantages, returns).
    """
    values = values.float() * mask
    rewards = token_rewards.float() * mask
    adv = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    for t in range(rewards.numel() - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < rewards.numel() else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        adv[t] = running
    return adv, adv + values


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    group_size: int,
    *,
    response_masks: list[torch.Tensor],
    log_probs: list[torch.Tensor] | None = None,
    ref_log_probs: list[torch.Tensor] | None = None,
    values: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> AdvantageOutput:
    """Per-token advantages (and returns) for one rollout batch.

    - ``grpo`` / ``gspo``: group advantages broadcast over each response (GSPO's sequence-level ratio
      lives in the loss: ``policy_loss(..., ratio_level="sequence")``); ``dr_grpo``: without std division.
      GRPO-style estimators ignore ``kl_coef`` (they use the KL loss instead).
    - ``reinforce_plus_plus``: reward at the last trained token, ``-kl_coef * k1`` on every trained token,
      discounted returns (``gamma``), then batch whitening over trained tokens.
    - ``reinforce_plus_plus_baseline``: reward minus its group mean, ``-kl_coef * k1`` per token, then
      batch whitening.
    - ``ppo``: GAE over token rewards (as REINFORCE++) with critic ``values``, ``gamma`` and ``lambd``.

    For the GRPO family the returns equal the advantages.
    """
    n = len(response_masks)
    rewards = rewards.float().reshape(-1)
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} response masks")
    masks = [m.float() for m in response_masks]
    if estimator in ("grpo", "dr_grpo", "gspo"):
        adv = group_advantages(rewards, group_size, normalize_std=estimator != "dr_grpo")
        per_token = [torch.full_like(m, float(a)) for a, m in zip(adv, masks, strict=True)]
        return AdvantageOutput(per_token, [t.clone() for t in per_token])
    kl = _token_kl(log_probs, ref_log_probs, n, kl_coef)
    if estimator == "reinforce_plus_plus":
        token_rewards = _token_rewards(rewards, masks, kl, kl_coef)
        returns = [_discounted_returns(r, gamma) for r in token_rewards]
        return AdvantageOutput(masked_whiten(returns, masks), returns)
    if estimator == "reinforce_plus_plus_baseline":
        baseline = group_advantages(rewards, group_size, normalize_std=False)
        raw = []
        for i, m in enumerate(masks):
            a = torch.full_like(m, float(baseline[i]))
            if kl is not None:
                a = a - kl_coef * kl[i].float() * m
            raw.append(a)
        return AdvantageOutput(masked_whiten(raw, masks), raw)
    if estimator == "ppo":
        if values is None or len(values) != n:
            raise ConfigError(
                "advantage_estimator='ppo': needs critic values for every sample; set use_critic=True"
            )
        token_rewards = _token_rewards(rewards, masks, kl, kl_coef)
        pairs = [gae(r, v, m, gamma, lambd) for r, v, m in zip(token_rewards, values, masks, strict=True)]
        return AdvantageOutput([p[0] for p in pairs], [p[1] for p in pairs])
    raise ConfigError(
        f"advantage_estimator={estimator!r}: unknown estimator; use one of {', '.join(ESTIMATORS)}"
    )
