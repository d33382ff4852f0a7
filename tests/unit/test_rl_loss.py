"""``raygym.algo.rl_loss``: the one RL loss both trainer backends call, against its parts computed here."""

from __future__ import annotations

import dataclasses
import math

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
                       tis_clip_low=0.0, tis_mode="truncate", tis_level="token", use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.1, entropy_coef=0.01,
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
        "loss", "pg_loss", "entropy", "clipfrac", "approx_kl", "dual_clipfrac", "kl_loss", "tis_weight",
        "tis_clipped_frac", "tis_masked_frac")
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
                    calculate_per_token_loss=True, eps_clip_c=2.5, tis_clip_low=0.5, tis_mode="mask",
                    tis_level="geometric")
    cfg = RLLossConfig.from_recipe(recipe)
    assert (cfg.tis_clip_low, cfg.tis_mode, cfg.tis_level) == (0.5, "mask", "geometric")
    assert (cfg.ratio_level, cfg.use_tis, cfg.tis_clip, cfg.entropy_coef, cfg.per_token, cfg.eps_clip_c) == (
        "sequence", True, 1.5, 0.02, True, 2.5)
    assert cfg.entropy_needs_grad and not loss_config().entropy_needs_grad


def off_policy_case():
    """Two samples, two tokens each; the trainer's log-probs are 0, so the importance ratios
    exp(old - rollout) are [[1, 3], [0.25, 1]]; advantages 1 and 2; ratio to the old policy 1."""
    lp = torch.zeros(2, 2, requires_grad=True)
    rollout = torch.tensor([[0.0, -math.log(3.0)], [math.log(4.0), 0.0]])
    return lp, rollout, torch.tensor([1.0, 2.0]), torch.ones(2, 2), torch.zeros(2, 2)


def test_truncated_weights_scale_the_token_losses_and_report_the_clipped_share():
    lp, rollout, adv, mask, entropy = off_policy_case()
    cfg = loss_config(use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    loss, m = rl_loss(lp, None, adv, mask, entropy=entropy, config=cfg, rollout_log_probs=rollout)
    # weights [[1, 2], [0.5, 1]]: token losses -A*w = [[-1, -2], [-1, -2]], per sample -1.5 and -1.5
    assert float(loss.detach()) == pytest.approx(-1.5) and float(m["pg_loss"]) == pytest.approx(-1.5)
    assert float(m["tis_weight"]) == pytest.approx((1.5 + 0.75) / 2)
    assert float(m["tis_clipped_frac"]) == pytest.approx(0.5) and float(m["tis_masked_frac"]) == 0.0


@pytest.mark.parametrize("per_token", [False, True])
def test_masked_tokens_add_nothing_to_the_loss_or_its_gradient(per_token):
    lp, rollout, adv, mask, entropy = off_policy_case()
    cfg = loss_config(use_tis=True, tis_mode="mask", tis_clip=2.0, tis_clip_low=0.5,
                      calculate_per_token_loss=per_token)
    loss, m = rl_loss(lp, None, adv, mask, entropy=entropy, config=cfg, rollout_log_probs=rollout)
    # IcePop band [0.5, 2]: ratios 3 and 0.25 are masked; kept token losses -1 and -2; masked tokens still
    # count in the denominators (per sample: (-1 + 0)/2 and (0 - 2)/2; per token: -3 / 4)
    assert float(loss.detach()) == pytest.approx(-0.75)
    assert float(m["tis_weight"]) == pytest.approx(0.5)
    assert float(m["tis_masked_frac"]) == pytest.approx(0.5) and float(m["tis_clipped_frac"]) == 0.0
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 1] == 0.0 and lp.grad[1, 0] == 0.0 and lp.grad[0, 0] != 0.0 and lp.grad[1, 1] != 0.0


def test_sequence_level_mask_drops_whole_samples():
    lp, rollout, adv, mask, entropy = off_policy_case()
    # sample ratios: 1 * 3 = 3 (outside [0.5, 2]) and 0.25 * 1 = 0.25 (outside): both samples dropped
    cfg = loss_config(use_tis=True, tis_mode="mask", tis_level="sequence", tis_clip=2.0, tis_clip_low=0.5)
    loss, m = rl_loss(lp, None, adv, mask, entropy=entropy, config=cfg, rollout_log_probs=rollout)
    assert float(loss.detach()) == 0.0 and float(m["tis_masked_frac"]) == 1.0 and float(m["tis_weight"]) == 0.0
    # geometric means sqrt(3) and 0.5 are inside the band: every token kept with its sample's weight
    cfg = dataclasses.replace(cfg, tis_level="geometric")
    loss, m = rl_loss(lp, None, adv, mask, entropy=entropy, config=cfg, rollout_log_probs=rollout)
    assert float(loss.detach()) == pytest.approx((-math.sqrt(3.0) - 2 * 0.5) / 2)
    assert float(m["tis_masked_frac"]) == 0.0


def test_without_use_tis_the_correction_fields_change_nothing():
    lp, old, ref, rollout, adv, mask, entropy = case(3)
    base = loss_config(entropy_coef=0.01)
    plain_loss, plain = rl_loss(lp, old, adv, mask, entropy=entropy, config=base)
    # the loss as it was before the correction fields existed: the clipped surrogate, no weights
    pg, _ = policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(plain_loss, pg - 0.01 * aggregate(entropy, mask))
    other = loss_config(entropy_coef=0.01, tis_mode="mask", tis_level="sequence", tis_clip_low=0.9, tis_clip=1.1)
    loss, metrics = rl_loss(lp, old, adv, mask, entropy=entropy, config=other, rollout_log_probs=rollout)
    assert torch.equal(loss, plain_loss) and metrics.keys() == plain.keys()
    assert all(torch.equal(metrics[k], plain[k]) for k in plain)
    assert not any(name.startswith("tis_") for name in other.metric_names())
