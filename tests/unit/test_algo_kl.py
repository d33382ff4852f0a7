"""KL estimators against their formulas, element by element."""

from __future__ import annotations

import math
import random

import pytest
import torch

from raygym.algo import kl_penalty
from raygym.errors import ConfigError


def test_hand_computed():
    lp, ref = torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -2.0, -1.0])
    # d = [0, 1, -1]
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.0, 1.0, -1.0])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.0, 0.5, 0.5])
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([0.0, math.exp(-1) - 1 + 1, math.e - 1 - 1])


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 6)])
def test_random_against_reference(shape):
    rng = random.Random(len(shape))
    lp = torch.tensor([-rng.random() * 20 for _ in range(math.prod(shape))]).reshape(shape)
    ref = torch.tensor([-rng.random() * 20 for _ in range(math.prod(shape))]).reshape(shape)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        got = kl_penalty(lp, ref, kind)
        assert got.shape == lp.shape
        for g, a, b in zip(
            got.flatten().tolist(), lp.flatten().tolist(), ref.flatten().tolist(), strict=True
        ):
            d = a - b
            expected = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}.get(kind)
            if kind == "low_var_kl":
                expected = min(max(math.exp(-d) - 1 + d, -10.0), 10.0)
            assert g == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_k3_is_non_negative_and_low_var_is_bounded():
    d = torch.linspace(-30, 30, 101)
    assert (kl_penalty(d, torch.zeros_like(d), "k3") >= 0).all()
    assert kl_penalty(d, torch.zeros_like(d), "low_var_kl").max() == 10.0


def test_unknown_kind_names_the_field():
    with pytest.raises(ConfigError, match="kl_loss_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")
