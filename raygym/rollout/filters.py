"""Dynamic-sampling (DAPO) group predicates: ``fn(group: list[Sample]) -> bool`` (True = keep).

``dynamic_sampling_filter_path`` names one of these (or any user function with that signature) as a
callable or an import path, e.g. ``"raygym.rollout.filters:drop_uniform_reward_groups"``.

>>> from raygym.types import Sample
>>> group = [Sample(prompt="p", prompt_tokens=[], group_index=0, reward=r) for r in (1.0, 1.0)]
>>> drop_uniform_reward_groups(group)
False
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from raygym.types import Sample

GroupFilter = Callable[[list[Sample]], bool]
DEFAULT_FILTER_PATH = "raygym.rollout.filters:drop_uniform_reward_groups"


def _rewards(group: Sequence[Sample]) -> list[float]:
    return [float(s.reward) if s.reward is not None else 0.0 for s in group]


def drop_uniform_reward_groups(group: list[Sample], *, tol: float = 1e-6) -> bool:
    """Keep a group only if its rewards are not all equal (their spread exceeds ``tol``): a group
    where every response scored the same gives zero GRPO advantage and no learning signal."""
    rewards = _rewards(group)
    return len(rewards) > 1 and max(rewards) - min(rewards) > tol


def nonzero_reward_std(group: list[Sample], *, tol: float = 1e-6) -> bool:
    """Keep a group whose reward standard deviation is above ``tol`` (DAPO's criterion)."""
    rewards = _rewards(group)
    if len(rewards) < 2:
        return False
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) > tol


def keep_all(group: list[Sample]) -> bool:
    """Keep every group (dynamic sampling off)."""
    return True


def load_group_filter(spec: Callable[..., Any] | str | None) -> GroupFilter | None:
    """The predicate named by ``dynamic_sampling_filter_path`` (callable or import path), or None."""
    from raygym.callables import load_callable

    return load_callable(spec, "dynamic_sampling_filter_path")


def split_groups(samples: Sequence[Sample], group_size: int) -> list[list[Sample]]:
    """Contiguous groups of ``group_size`` samples (the rollout order)."""
    if group_size <= 0 or len(samples) % group_size:
        raise ValueError(f"{len(samples)} samples do not split into groups of {group_size}")
    return [list(samples[i : i + group_size]) for i in range(0, len(samples), group_size)]
