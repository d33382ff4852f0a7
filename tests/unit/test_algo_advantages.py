"""Advantage estimators against hand-computed cases and a loop-based reference written here."""

from __future__ import annotations

import math
import random

import pytest
import torch

from raygym.algo import compute_advantages, group_advantages
from raygym.errors import ConfigError


def reference_group_advantages(
    rewards: list[float], n: int, normalize_std: bool, eps: float = 1e-6
) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1)) if n > 1 else 0.0
        for r in group:
            out.append((r - mean) / (std + eps) if normalize_std and n > 1 else r - mean)
    return out


def test_grpo_hand_computed():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    # each group: mean 0.5, unbiased std sqrt(0.5) = 0.7071
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected])


def test_equal_rewards_give_zero_not_nan_and_group_size_one_skips_std():
    assert group_advantages(torch.full((6,), 3.0), 3).tolist() == [0.0] * 6
    assert group_advantages(torch.tensor([2.0, -1.0]), 1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_match_reference(n, normalize_std):
    rng = random.Random(n)
    for groups in (1, 3, 7):
        rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(groups * n)]
        got = group_advantages(torch.tensor(rewards), n, normalize_std=normalize_std)
        assert got.tolist() == pytest.approx(reference_group_advantages(rewards, n, normalize_std), abs=1e-5)


def test_bad_group_size_names_the_field():
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        group_advantages(torch.zeros(5), 2)


def masks_for(lengths, rng):
    return [torch.tensor([float(rng.random() > 0.3) for _ in range(n)]) for n in lengths]


def test_grpo_family_broadcasts_per_token():
    masks = [torch.ones(3), torch.ones(1), torch.tensor([1.0, 0.0]), torch.ones(2)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    out = compute_advantages("grpo", rewards, 2, response_masks=masks)
    ref = reference_group_advantages(rewards.tolist(), 2, True)
    for a, m, r in zip(out.advantages, masks, ref, strict=True):
        assert a.shape == m.shape and a.tolist() == pytest.approx([r] * len(m), abs=1e-6)
    dr = compute_advantages("dr_grpo", rewards, 2, response_masks=masks)
    assert dr.advantages[0].tolist() == pytest.approx([0.5] * 3)
    gspo = compute_advantages("gspo", rewards, 2, response_masks=masks)
    assert all(torch.equal(x, y) for x, y in zip(gspo.advantages, out.advantages, strict=True))
    # GRPO ignores kl_coef (KL is a loss term there), so no log-probs are needed
    compute_advantages("grpo", rewards, 2, response_masks=masks, kl_coef=0.5)


def reference_reinforce_pp(rewards, masks, lp, ref, kl_coef, gamma):
    returns = []
    for i, m in enumerate(masks):
        m = m.tolist()
        tok = [-kl_coef * (lp[i][t] - ref[i][t]) * m[t] for t in range(len(m))]
        ones = [t for t in range(len(m)) if m[t] > 0]
        last = ones[-1] if ones else len(m) - 1
        if m:
            tok[last] += rewards[i]
        ret, run = [0.0] * len(m), 0.0
        for t in reversed(range(len(m))):
            run = tok[t] + gamma * run
            ret[t] = run
        returns.append(ret)
    flat = [(x, mm) for r, m in zip(returns, masks, strict=True) for x, mm in zip(r, m.tolist(), strict=True)]
    cnt = max(sum(mm for _, mm in flat), 1.0)
    mean = sum(x * mm for x, mm in flat) / cnt
    var = sum((x - mean) ** 2 * mm for x, mm in flat) / cnt
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in r] for r in returns], returns


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_plus_plus_matches_reference(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(1, 9) for _ in range(6)]
    masks = masks_for(lengths, rng)
    masks[2] = torch.zeros(lengths[2])  # an empty mask row
    lp = [[-rng.random() * 3 for _ in range(n)] for n in lengths]
    ref = [[-rng.random() * 3 for _ in range(n)] for n in lengths]
    rewards = [rng.random() for _ in lengths]
    gamma, kl_coef = 0.9, 0.1
    out = compute_advantages(
        "reinforce_plus_plus",
        torch.tensor(rewards),
        2,
        response_masks=masks,
        log_probs=[torch.tensor(x) for x in lp],
        ref_log_probs=[torch.tensor(x) for x in ref],
        kl_coef=kl_coef,
        gamma=gamma,
    )
    exp_adv, exp_ret = reference_reinforce_pp(rewards, masks, lp, ref, kl_coef, gamma)
    for a, r, ea, er in zip(out.advantages, out.returns, exp_adv, exp_ret, strict=True):
        assert a.tolist() == pytest.approx(ea, abs=1e-4)
        assert r.tolist() == pytest.approx(er, abs=1e-5)
        assert not torch.isnan(a).any()


def test_reinforce_plus_plus_baseline():
    masks = [torch.ones(2), torch.ones(1), torch.ones(3), torch.ones(2)]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out = compute_advantages("reinforce_plus_plus_baseline", rewards, 2, response_masks=masks)
    raw = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]  # reward - group mean, per token
    mean = sum(raw) / 8
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 8 + 1e-8)
    assert torch.cat(out.advantages).tolist() == pytest.approx([(x - mean) / std for x in raw], abs=1e-5)


def test_kl_in_reward_requires_log_probs():
    with pytest.raises(ConfigError, match="kl_coef"):
        compute_advantages(
            "reinforce_plus_plus", torch.ones(2), 2, response_masks=[torch.ones(1)] * 2, kl_coef=0.1
        )


def reference_gae(rewards, values, gamma, lambd):
    adv, run = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        nv = values[t + 1] if t + 1 < len(rewards) else 0.0
        run = rewards[t] + gamma * nv - values[t] + gamma * lambd * run
        adv[t] = run
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_ppo_gae_hand_computed_and_reference():
    # one token, reward 1, value 0.25: advantage 0.75, return 1
    out = compute_advantages(
        "ppo", torch.tensor([1.0]), 1, response_masks=[torch.ones(1)], values=[torch.tensor([0.25])]
    )
    assert out.advantages[0].tolist() == pytest.approx([0.75]) and out.returns[0].tolist() == pytest.approx(
        [1.0]
    )
    rng = random.Random(7)
    lengths = [5, 3, 7]
    values = [[rng.random() for _ in range(n)] for n in lengths]
    rewards = [1.0, 0.0, 0.5]
    out = compute_advantages(
        "ppo",
        torch.tensor(rewards),
        1,
        response_masks=[torch.ones(n) for n in lengths],
        values=[torch.tensor(v) for v in values],
        gamma=0.95,
        lambd=0.9,
    )
    for i, n in enumerate(lengths):
        tok = [0.0] * (n - 1) + [rewards[i]]
        ea, er = reference_gae(tok, values[i], 0.95, 0.9)
        assert out.advantages[i].tolist() == pytest.approx(ea, abs=1e-5)
        assert out.returns[i].tolist() == pytest.approx(er, abs=1e-5)
    with pytest.raises(ConfigError, match="use_critic"):
        compute_advantages("ppo", torch.ones(1), 1, response_masks=[torch.ones(1)])


def test_unknown_estimator():
    with pytest.raises(ConfigError, match="advantage_estimator"):
        compute_advantages("nope", torch.ones(1), 1, response_masks=[torch.ones(1)])
