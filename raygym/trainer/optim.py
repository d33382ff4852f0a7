"""Optimizers and learning-rate schedules for the torch backend.

Schedule (Megatron-style, per optimizer step ``s`` counted from 0):
warmup ``lr * (s + 1) / lr_warmup_iters`` for ``s < lr_warmup_iters``; then over
``[lr_warmup_iters, lr_decay_iters]`` decay from ``lr`` to ``min_lr`` (``constant`` keeps ``lr``,
``linear`` straight line, ``cosine`` half cosine); ``min_lr`` after ``lr_decay_iters``.

>>> [round(lr_at(s, lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=4, style="linear"), 3) for s in range(6)]
[0.5, 1.0, 1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import torch

from raygym.errors import ConfigError

LR_STYLES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adam", "adamw", "sgd")


def lr_at(
    step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int | None, style: str
) -> float:
    """Learning rate of optimizer step ``step`` (0-based); see the module docstring."""
    if style not in LR_STYLES:
        raise ConfigError(f"lr_decay_style={style!r}: unknown schedule; use one of {', '.join(LR_STYLES)}")
    if warmup_iters > 0 and step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if style == "constant":
        return lr
    if decay_iters is None or decay_iters <= warmup_iters:
        return lr
    progress = min(max((step - warmup_iters) / (decay_iters - warmup_iters), 0.0), 1.0)
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LrSchedule:
    """Sets each param group's lr before every optimizer step; its state is just the step counter.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    >>> sched = LrSchedule(opt, lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=2, style="linear")
    >>> sched.apply(), sched.advance(), sched.apply()
    (1.0, None, 0.5)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int | None,
        style: str,
    ) -> None:
        lr_at(
            0, lr=lr, min_lr=min_lr, warmup_iters=warmup_iters, decay_iters=decay_iters, style=style
        )  # validate
        self.optimizer = optimizer
        self.lr, self.min_lr, self.warmup_iters = lr, min_lr, warmup_iters
        self.decay_iters, self.style = decay_iters, style
        self.step = 0

    def current_lr(self) -> float:
        return lr_at(
            self.step,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_iters=self.warmup_iters,
            decay_iters=self.decay_iters,
            style=self.style,
        )

    def apply(self) -> float:
        """Write the current step's lr into every param group and return it."""
        value = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = value
        return value

    def advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def split_frozen(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], patterns: Sequence[str] | None
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[str]]:
    """Apply ``freeze_params_name_list``: params whose name ``re.search``-matches a pattern get
    ``requires_grad=False``. Returns (trainable named params, frozen names)."""
    compiled = []
    for p in patterns or []:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(
                f"freeze_params_name_list: {p!r} is not a valid regular expression ({exc})"
            ) from exc
    trainable, frozen = [], []
    for name, param in named_params:
        if any(c.search(name) for c in compiled):
            param.requires_grad_(False)
            frozen.append(name)
        elif param.requires_grad:
            trainable.append((name, param))
    return trainable, frozen


def build_optimizer(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    *,
    name: str,
    lr: float,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    adam_eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """Optimizer over ``named_params``. ``"adam"`` is AdamW (decoupled decay, as Megatron's adam).

    As in Megatron, weight decay applies to matrices only; biases and norm weights (1-D) get none.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer={name!r}: unknown optimizer; use one of {', '.join(OPTIMIZERS)}")
    if not named_params:
        raise ConfigError("freeze_params_name_list: every parameter is frozen; nothing left to train")
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    # foreach=False: the same kernels on every world size, so 1 rank and N ranks match closely.
    return torch.optim.AdamW(groups, lr=lr, betas=(adam_beta1, adam_beta2), eps=adam_eps, foreach=False)
