"""Policy / KL / value losses and aggregation against a per-token loop reference written here."""

from __future__ import annotations

import math
import random

import pytest
import torch

from raygym.algo import aggregate, entropy_from_logits, kl_loss, policy_loss, tis_weights, value_loss
from raygym.algo.losses import importance_weights
from raygym.errors import ConfigError


def ref_token_loss(lp, old, a, eps_lo, eps_hi, c=None, w=1.0):
    r = math.exp(lp - old)
    loss = max(-r * a, -min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss * w


def ref_aggregate(rows, masks, per_token, num_samples=None, num_tokens=None):
    if per_token:
        total = sum(
            x * m for row, mrow in zip(rows, masks, strict=True) for x, m in zip(row, mrow, strict=True)
        )
        count = num_tokens if num_tokens is not None else sum(sum(m) for m in masks)
        return total / max(count, 1)
    per_sample = [
        sum(x * m for x, m in zip(row, mrow, strict=True)) / max(sum(mrow), 1)
        for row, mrow in zip(rows, masks, strict=True)
    ]
    return sum(per_sample) / max(num_samples if num_samples is not None else len(rows), 1)


def random_case(rng, b, t, empty_row=True):
    lp = [[-rng.random() * 4 for _ in range(t)] for _ in range(b)]
    old = [[x + rng.uniform(-0.6, 0.6) for x in row] for row in lp]
    adv = [[rng.uniform(-2, 2) for _ in range(t)] for _ in range(b)]
    mask = [[float(rng.random() > 0.3) for _ in range(t)] for _ in range(b)]
    if empty_row:
        mask[0] = [0.0] * t
    return lp, old, adv, mask


def test_hand_computed_clipping():
    # ratio e^0.5 = 1.6487 clipped at 1.28 for A > 0; ratio e^-0.5 = 0.6065 clipped at 0.8 for A < 0
    lp = torch.tensor([[0.5, -0.5]])
    old = torch.zeros(1, 2)
    loss, m = policy_loss(
        lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), eps_clip=0.2, eps_clip_high=0.28
    )
    assert float(loss) == pytest.approx((-1.28 + 0.8) / 2)
    assert float(m["clipfrac"]) == pytest.approx(1.0)
    assert float(m["approx_kl"]) == pytest.approx(0.0)


@pytest.mark.parametrize("b,t", [(1, 1), (3, 5), (8, 17)])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_matches_reference(b, t, per_token, dual):
    rng = random.Random(b * 100 + t)
    lp, old, adv, mask = random_case(rng, b, t)
    w = [[rng.uniform(0, 2) for _ in range(t)] for _ in range(b)]
    loss, metrics = policy_loss(
        torch.tensor(lp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64),
        eps_clip=0.2,
        eps_clip_high=0.28,
        per_token=per_token,
        eps_clip_c=dual,
        tis_weights=torch.tensor(w, dtype=torch.float64),
    )
    rows = [
        [ref_token_loss(lp[i][j], old[i][j], adv[i][j], 0.2, 0.28, dual, w[i][j]) for j in range(t)]
        for i in range(b)
    ]
    assert float(loss) == pytest.approx(ref_aggregate(rows, mask, per_token), rel=1e-9, abs=1e-12)
    kl_rows = [[old[i][j] - lp[i][j] for j in range(t)] for i in range(b)]
    assert float(metrics["approx_kl"]) == pytest.approx(ref_aggregate(kl_rows, mask, per_token), abs=1e-12)
    assert 0.0 <= float(metrics["clipfrac"]) <= 1.0


def test_sample_level_advantages_broadcast():
    rng = random.Random(3)
    lp, old, _, mask = random_case(rng, 4, 6)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0])
    a, _ = policy_loss(
        torch.tensor(lp), torch.tensor(old), adv, torch.tensor(mask), eps_clip=0.2, eps_clip_high=0.2
    )
    b, _ = policy_loss(
        torch.tensor(lp),
        torch.tensor(old),
        adv[:, None].expand(4, 6),
        torch.tensor(mask),
        eps_clip=0.2,
        eps_clip_high=0.2,
    )
    assert float(a) == float(b)


@pytest.mark.parametrize("per_token", [False, True])
def test_micro_batches_with_global_denominators_sum_to_full_batch(per_token):
    rng = random.Random(11)
    lp, old, adv, mask = random_case(rng, 9, 7)
    full = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    args = dict(eps_clip=0.2, eps_clip_high=0.28, per_token=per_token)
    whole, _ = policy_loss(
        full,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64),
        **args,
    )
    (grad_whole,) = torch.autograd.grad(whole, full)
    total, grads = 0.0, []
    n_tokens = sum(sum(m) for m in mask)
    for lo, hi in ((0, 2), (2, 7), (7, 9)):
        part = torch.tensor(lp[lo:hi], dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss(
            part,
            torch.tensor(old[lo:hi], dtype=torch.float64),
            torch.tensor(adv[lo:hi], dtype=torch.float64),
            torch.tensor(mask[lo:hi], dtype=torch.float64),
            num_samples=9,
            num_tokens=n_tokens,
            **args,
        )
        total += float(loss.detach())
        grads.append(torch.autograd.grad(loss, part)[0])
    assert total == pytest.approx(float(whole.detach()), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), grad_whole, rtol=1e-12, atol=1e-15)


def test_gspo_sequence_ratio():
    lp = torch.tensor([[0.2, 0.4, 9.0]])  # third token masked out
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(
        lp, old, torch.tensor([1.0]), mask, eps_clip=0.5, eps_clip_high=0.5, ratio_level="sequence"
    )
    assert float(loss) == pytest.approx(-math.exp(0.3))  # geometric-mean ratio 1.35 < 1.5: not clipped


def test_dual_clip_validation():
    with pytest.raises(ConfigError, match="eps_clip_c"):
        policy_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1),
            torch.ones(1, 1),
            eps_clip=0.2,
            eps_clip_high=0.2,
            eps_clip_c=0.5,
        )


def test_tis_weights_are_truncated():
    w = tis_weights(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, -5.0]), 2.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(-1.0), 2.0])


def log_ratios(rows):
    """(old, rollout) log-probs whose differences old - rollout are ``rows``."""
    d = torch.tensor(rows, dtype=torch.float32)
    old = -torch.rand(d.shape, generator=torch.Generator().manual_seed(1)) * 3
    return old, old - d


def test_token_truncation_clamps_into_the_band_from_below_too():
    old, rollout = log_ratios([[0.0, math.log(3.0), math.log(0.25), math.log(1.5)]])
    w = importance_weights(old, rollout, torch.ones(1, 4), clip=2.0, clip_low=0.5)
    assert w.weights[0].tolist() == pytest.approx([1.0, 2.0, 0.5, 1.5])
    assert w.clipped[0].tolist() == [0.0, 1.0, 1.0, 0.0] and w.masked.sum() == 0
    # tis_clip_low=0 is the plain truncation of tis_weights
    plain = importance_weights(old, rollout, torch.ones(1, 4), clip=2.0)
    assert plain.weights[0].tolist() == pytest.approx([1.0, 2.0, 0.25, 1.5])
    assert plain.clipped[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(plain.weights, tis_weights(old, rollout, 2.0))


def test_token_mask_zeroes_ratios_outside_the_band_and_keeps_the_others_unclamped():
    old, rollout = log_ratios([[0.0, math.log(3.0), math.log(0.25), math.log(1.5), math.log(0.5)]])
    w = importance_weights(old, rollout, torch.ones(1, 5), clip=2.0, clip_low=0.5, mode="mask")
    assert w.weights[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5, 0.5])  # the bounds are inside
    assert w.masked[0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0] and w.clipped.sum() == 0
    assert not w.weights.requires_grad


# Two samples; padding and tokens the policy did not produce (mask 0) carry huge log ratios that
# must not count. Sample 0: ratios 2 and 1.5 (sequence 3, geometric sqrt 3); sample 1: 0.5 and 0.8
# (sequence 0.4, geometric sqrt 0.4).
SEQ_DIFFS = [[math.log(2.0), math.log(1.5), 100.0], [math.log(0.5), -80.0, math.log(0.8)]]
SEQ_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])


@pytest.mark.parametrize(
    "level, mode, low, high, sample_weights, flagged",
    [("sequence", "truncate", 0.5, 2.0, [2.0, 0.5], [1.0, 1.0]),
     ("sequence", "mask", 0.5, 4.0, [3.0, 0.0], [0.0, 1.0]),
     ("geometric", "truncate", 0.7, 2.0, [math.sqrt(3.0), 0.7], [0.0, 1.0]),
     ("geometric", "mask", 0.5, 2.0, [math.sqrt(3.0), math.sqrt(0.4)], [0.0, 0.0]),
     ("geometric", "mask", 0.7, 2.0, [math.sqrt(3.0), 0.0], [0.0, 1.0])],
)  # fmt: skip
def test_sequence_levels_weight_every_token_of_a_sample_from_its_loss_tokens_only(
        level, mode, low, high, sample_weights, flagged):
    old, rollout = log_ratios(SEQ_DIFFS)
    w = importance_weights(old, rollout, SEQ_MASK, clip=high, clip_low=low, mode=mode, level=level)
    for i in range(2):
        assert w.weights[i].tolist() == pytest.approx([sample_weights[i]] * 3, rel=1e-5)
        flags = w.masked[i] if mode == "mask" else w.clipped[i]
        assert flags.tolist() == [flagged[i]] * 3
    assert (w.clipped if mode == "mask" else w.masked).sum() == 0


def test_a_sample_without_loss_tokens_has_ratio_one():
    old, rollout = log_ratios([[5.0, -5.0]])
    for level in ("sequence", "geometric"):
        w = importance_weights(old, rollout, torch.zeros(1, 2), clip=2.0, level=level)
        assert w.weights.tolist() == [[1.0, 1.0]]


def test_unknown_mode_or_level_is_a_config_error():
    old, rollout = log_ratios([[0.0]])
    with pytest.raises(ConfigError, match="tis_mode='clip'"):
        importance_weights(old, rollout, torch.ones(1, 1), clip=2.0, mode="clip")
    with pytest.raises(ConfigError, match="tis_level='seq'"):
        importance_weights(old, rollout, torch.ones(1, 1), clip=2.0, level="seq")


def test_entropy_is_stable_and_correct():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, -1000.0]])
    ent = entropy_from_logits(logits)
    assert ent[0] == pytest.approx(math.log(4)) and ent[1] == pytest.approx(0.0, abs=1e-6)
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(5, 11, generator=rng, dtype=torch.float64)
    p = torch.softmax(x, -1)
    torch.testing.assert_close(entropy_from_logits(x).double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)


def test_kl_loss_aggregates_estimator():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -2.0]])
    assert float(kl_loss(lp, ref, torch.ones(1, 2), "k1")) == pytest.approx(0.5)
    assert float(kl_loss(lp, ref, torch.tensor([[1.0, 0.0]]), "k2", per_token=True)) == pytest.approx(0.5)


def test_value_loss_clipped():
    values, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
    loss, m = value_loss(values, old, ret, torch.ones(1, 2), value_clip=0.2, per_token=True)
    # token 0: v moves 0 -> 1 but clipped to 0.2: max((1-2)^2, (0.2-2)^2) = 3.24; token 1: 1
    assert float(loss) == pytest.approx(0.5 * (3.24 + 1.0) / 2)
    assert float(m["value_clipfrac"]) == pytest.approx(0.5)
    plain, _ = value_loss(values, old, ret, torch.ones(1, 2), value_clip=None, per_token=True)
    assert float(plain) == pytest.approx(0.5 * (1.0 + 1.0) / 2)


def test_empty_mask_rows_do_not_make_nan():
    x = torch.ones(3, 4)
    mask = torch.zeros(3, 4)
    assert float(aggregate(x, mask)) == 0.0 and float(aggregate(x, mask, per_token=True)) == 0.0
    mask[1, :2] = 1
    assert float(aggregate(x, mask)) == pytest.approx(1 / 3)  # empty rows still count as samples
