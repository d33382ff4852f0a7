"""``raygym.algo.rl_loss``: the one RL loss both trainer backends call, against its parts computed here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raygym.algo import RLLossConfig, aggregate, kl_loss, policy_loss, ratio_level_for, rl_loss, tis_weights
from raygym.config import Recipe
from raygym.errors import ConfigError


def loss_config(**fields) -> RLLossConfig:
    return RLLossConfig.from_recipe(Recipe(**fields))


def case(seed: int = 0, b: int = 3, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + (torch.rand(b, t, generator=g) - 0.5)
    ref = lp + (torch.rand(b, t, generator=g) - 0.5)
    rollout = old + (torch.rand(b, t, generator=g) - 0.5) * 0.2
    adv = torch.randn(b, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    entropy = torch.rand(b, t, generator=g) * 2
    return lp.requires_grad_(), old, ref, rollout, adv, mask, entropy


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_total_is_pg_plus_kl_minus_entropy_with_tis_and_dual_clip(per_token, estimator):
    lp, old, ref, rollout, adv, mask, entropy = case()
    cfg = RLLossConfig(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, use_tis=True, tis_clip=2.0,
                       use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.1, entropy_coef=0.01,
                       ratio_level=ratio_level_for(estimator), per_token=per_token)
    agg = {"per_token": per_token, "num_samples": 5, "num_tokens": 20}
    loss, metrics = rl_loss(lp, old, adv, mask, entropy=entropy, config=cfg, ref_log_probs=ref,
                            rollout_log_probs=rollout, num_samples=5, num_tokens=20)
    weights = tis_weights(old, rollout, 2.0)
    pg, pg_metrics = policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0,
                                 tis_weights=weights, ratio_level=cfg.ratio_level, **agg)
    kl = kl_loss(lp, ref, mask, "k3", **agg)
    ent = aggregate(entropy, mask, **agg)
    torch.testing.assert_close(loss, pg + 0.1 * kl - 0.01 * ent)
    assert tuple(metrics) == cfg.metric_names() == (
        "loss", "pg_loss", "entropy", "clipfrac", "approx_kl", "dual_clipfrac", "kl_loss", "tis_weight")
    torch.testing.assert_close(metrics["kl_loss"], kl.detach())
    torch.testing.assert_close(metrics["tis_weight"], aggregate(weights, mask, **agg))
    torch.testing.assert_close(metrics["dual_clipfrac"], pg_metrics["dual_clipfrac"])
    assert all(not m.requires_grad for m in metrics.values())
    loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0


def test_plain_config_reports_only_what_is_on_and_old_none_means_current():
    lp, _, _, _, adv, mask, entropy = case(1)
    cfg = loss_config()
    loss, metrics = rl_loss(lp, None, adv, mask, entropy=entropy, config=cfg)
    assert tuple(metrics) == ("loss", "pg_loss", "entropy", "clipfrac", "approx_kl")
    # the old policy is the current one: ratio 1, nothing clipped, no KL between them
    assert float(metrics["clipfrac"]) == 0.0 and float(metrics["approx_kl"]) == 0.0
    torch.testing.assert_close(loss, -aggregate(adv[:, None].expand_as(lp), mask))


def test_missing_inputs_are_config_errors_not_silent_skips():
    lp, old, _, _, adv, mask, entropy = case(2)
    with pytest.raises(ConfigError, match="use_tis=True"):
        rl_loss(lp, old, adv, mask, entropy=entropy, config=loss_config(use_tis=True))
    with pytest.raises(ConfigError, match="use_kl_loss=True"):
        rl_loss(lp, old, adv, mask, entropy=entropy, config=loss_config(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ConfigError, match="ratio_level"):
        dataclasses.replace(loss_config(), ratio_level="group")


def test_from_recipe_reads_the_recipe_fields():
    recipe = Recipe(advantage_estimator="gspo", use_tis=True, tis_clip=1.5, entropy_coef=0.02,
                    calculate_per_token_loss=True, eps_clip_c=2.5)
    cfg = RLLossConfig.from_recipe(recipe)
    assert (cfg.ratio_level, cfg.use_tis, cfg.tis_clip, cfg.entropy_coef, cfg.per_token, cfg.eps_clip_c) == (
        "sequence", True, 1.5, 0.02, True, 2.5)
    assert cfg.entropy_needs_grad and not loss_config().entropy_needs_grad
