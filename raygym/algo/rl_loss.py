"""The one RL policy loss every trainer backend calls: clip (and dual clip), truncated importance sampling,
the KL loss against the reference, the entropy bonus, GSPO's sequence ratio and the aggregation, with the
same metrics whatever the backend.

A backend computes, for one micro-batch, padded ``[B, T]`` tensors of the current log-probs (with grad)
and token entropies, then calls :func:`rl_loss` with the step's GLOBAL denominators (see
:mod:`raygym.algo.losses`): the per-micro-batch losses and metrics then add up to the optimizer step's.

Metrics (:meth:`RLLossConfig.metric_names`, in that order; summed over micro-batches and data-parallel
ranks): ``loss`` (the total that is back-propagated), ``pg_loss``, ``entropy``, ``clipfrac``,
``approx_kl``, and only when the feature is on: ``dual_clipfrac`` (``eps_clip_c``), ``kl_loss``
(``use_kl_loss``), ``tis_weight``, ``tis_clipped_frac`` and ``tis_masked_frac`` (``use_tis``: the mean
importance weight and the share of loss tokens whose weight was truncated (``tis_mode="truncate"``) or
set to 0 (``"mask"``), aggregated like the loss).

>>> import torch
>>> from raygym.config import Recipe
>>> cfg = RLLossConfig.from_recipe(Recipe(entropy_coef=0.5))
>>> lp = torch.zeros(1, 2); mask = torch.ones(1, 2)
>>> loss, m = rl_loss(lp, lp, torch.tensor([1.0]), mask, entropy=torch.ones(1, 2), config=cfg)
>>> float(loss), float(m["pg_loss"]), float(m["entropy"]), cfg.metric_names()
(-1.5, -1.0, 1.0, ('loss', 'pg_loss', 'entropy', 'clipfrac', 'approx_kl'))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raygym.algo.kl import KL_KINDS
from raygym.algo.losses import (
    TIS_LEVELS,
    TIS_MODES,
    Aggregation,
    aggregate,
    importance_weights,
    kl_loss,
    policy_loss,
)
from raygym.config.recipe import Recipe
from raygym.config.views import build_view, recipe_view
from raygym.errors import ConfigError

# Advantage estimators whose importance ratio is taken per sequence (GSPO); every other one is per token.
SEQUENCE_RATIO_ESTIMATORS = ("gspo",)


def ratio_level_for(advantage_estimator: str) -> str:
    """``"sequence"`` for GSPO, ``"token"`` for every other estimator.

    >>> ratio_level_for("gspo"), ratio_level_for("grpo")
    ('sequence', 'token')
    """
    return "sequence" if advantage_estimator in SEQUENCE_RATIO_ESTIMATORS else "token"


@recipe_view(extras=("ratio_level", "per_token"))
@dataclass(frozen=True)
class RLLossConfig:
    """The loss fields of a recipe (same names), plus the ratio level derived from the estimator and
    ``per_token`` (``calculate_per_token_loss``). Build it with :meth:`from_recipe`."""

    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    tis_mode: str
    tis_level: str
    use_kl_loss: bool
    kl_loss_type: str
    kl_loss_coef: float
    entropy_coef: float
    ratio_level: str
    per_token: bool

    def __post_init__(self) -> None:
        if self.ratio_level not in ("token", "sequence"):
            raise ConfigError(f"ratio_level={self.ratio_level!r}: use 'token' (PPO/GRPO) or 'sequence' (GSPO)")
        if self.use_kl_loss and self.kl_loss_type not in KL_KINDS:
            raise ConfigError(f"kl_loss_type={self.kl_loss_type!r}: use one of {', '.join(KL_KINDS)}")
        if self.tis_mode not in TIS_MODES or self.tis_level not in TIS_LEVELS:
            raise ConfigError(f"tis_mode={self.tis_mode!r}, tis_level={self.tis_level!r}: use a mode of "
                              f"{', '.join(TIS_MODES)} and a level of {', '.join(TIS_LEVELS)}")

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> RLLossConfig:
        """The loss view of a validated recipe."""
        return build_view(cls, recipe, ratio_level=ratio_level_for(recipe.advantage_estimator),
                          per_token=recipe.calculate_per_token_loss)

    def metric_names(self) -> tuple[str, ...]:
        """The metrics :func:`rl_loss` returns for this config, in a fixed order (for all-reduces)."""
        names = ["loss", "pg_loss", "entropy", "clipfrac", "approx_kl"]
        if self.eps_clip_c is not None:
            names.append("dual_clipfrac")
        if self.use_kl_loss:
            names.append("kl_loss")
        if self.use_tis:
            names += ["tis_weight", "tis_clipped_frac", "tis_masked_frac"]
        return tuple(names)

    @property
    def entropy_needs_grad(self) -> bool:
        """The entropy enters the loss; otherwise it is a metric and may be computed without grad."""
        return self.entropy_coef != 0.0


def rl_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    entropy: torch.Tensor,
    config: RLLossConfig,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    num_samples: int | float | None = None,
    num_tokens: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch and its metrics (detached), all ``[B, T]`` inputs padded alike.

    ``old_log_probs=None``: the old policy is the current one (one optimizer step per rollout), so the
    detached ``log_probs`` stand in. ``ref_log_probs`` is required with ``use_kl_loss``;
    ``rollout_log_probs`` with ``use_tis`` (a ConfigError otherwise: never a silent skip).
    ``loss = pg_loss + kl_loss_coef * kl_loss - entropy_coef * entropy``.
    """
    c = config
    agg: Aggregation = {"per_token": c.per_token, "num_samples": num_samples, "num_tokens": num_tokens}
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    correction = None
    if c.use_tis:
        if rollout_log_probs is None:
            raise ConfigError(
                "use_tis=True: the samples carry no rollout log-probs; the engine must return them "
                "(or pass --no-use-tis)"
            )
        correction = importance_weights(old, rollout_log_probs, loss_mask, clip=c.tis_clip,
                                        clip_low=c.tis_clip_low, mode=c.tis_mode, level=c.tis_level)
    weights = None if correction is None else correction.weights
    pg, pg_metrics = policy_loss(
        log_probs, old, advantages, loss_mask, eps_clip=c.eps_clip, eps_clip_high=c.eps_clip_high,
        eps_clip_c=c.eps_clip_c, tis_weights=weights, ratio_level=c.ratio_level, **agg,
    )
    ent = aggregate(entropy, loss_mask, **agg)
    loss = pg - c.entropy_coef * ent if c.entropy_coef != 0.0 else pg
    metrics: dict[str, torch.Tensor] = {"pg_loss": pg.detach(), "entropy": ent.detach(), **pg_metrics}
    if c.use_kl_loss:
        if ref_log_probs is None:
            raise ConfigError(
                "use_kl_loss=True: the batch has no ref_log_probs; compute_log_probs of a trainer with a "
                "reference model adds them"
            )
        kl = kl_loss(log_probs, ref_log_probs, loss_mask, c.kl_loss_type, **agg)
        loss = loss + c.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
    if correction is not None:
        metrics["tis_weight"] = aggregate(correction.weights, loss_mask, **agg).detach()
        metrics["tis_clipped_frac"] = aggregate(correction.clipped, loss_mask, **agg).detach()
        metrics["tis_masked_frac"] = aggregate(correction.masked, loss_mask, **agg).detach()
    metrics["loss"] = loss.detach()
    return loss, {name: metrics[name] for name in c.metric_names()}
