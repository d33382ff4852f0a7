"""Learning-rate schedules, optimizer construction and freezing."""

from __future__ import annotations

import math

import pytest
import torch

from raygym.errors import ConfigError
from raygym.trainer.optim import LrSchedule, build_optimizer, lr_at, split_frozen


def test_warmup_then_constant():
    got = [lr_at(s, lr=1.0, min_lr=0.0, warmup_iters=4, decay_iters=None, style="constant") for s in range(6)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_and_cosine_reach_min_lr():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=12)
    lin = [lr_at(s, style="linear", **kw) for s in range(15)]
    cos = [lr_at(s, style="cosine", **kw) for s in range(15)]
    assert (
        lin[2] == pytest.approx(1.0)
        and lin[7] == pytest.approx(0.55)
        and lin[12:] == pytest.approx([0.1] * 3)
    )
    assert cos[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos[12:] == pytest.approx([0.1] * 3)
    assert all(a >= b for a, b in zip(cos[2:], cos[3:], strict=False))


def test_unknown_style_names_the_field():
    with pytest.raises(ConfigError, match="lr_decay_style"):
        lr_at(0, lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=None, style="step")


def test_schedule_drives_optimizer_and_round_trips():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.SGD([p], lr=0.0)
    sched = LrSchedule(opt, lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=4, style="linear")
    for _ in range(2):
        sched.apply()
        sched.advance()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.75)
    other = LrSchedule(opt, lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=4, style="linear")
    other.load_state_dict(sched.state_dict())
    assert other.current_lr() == pytest.approx(0.5)


def test_freeze_and_weight_decay_groups():
    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    trainable, frozen = split_frozen(model.named_parameters(), [r"^0\."])
    assert frozen == ["0.weight"] and not model[0].weight.requires_grad
    opt = build_optimizer(trainable, name="adam", lr=0.1, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.98)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and [p.shape for p in decay["params"]] == [(3, 3)]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)
    with pytest.raises(ConfigError, match="freeze_params_name_list"):
        split_frozen(model.named_parameters(), ["("])
    with pytest.raises(ConfigError, match="optimizer"):
        build_optimizer(trainable, name="lion", lr=0.1, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.9)
