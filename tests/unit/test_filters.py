"""Dynamic-sampling group predicates and group splitting."""

from __future__ import annotations

import pytest

from raygym.errors import ConfigError
from raygym.rollout.filters import (
    DEFAULT_FILTER_PATH,
    drop_uniform_reward_groups,
    keep_all,
    load_group_filter,
    nonzero_reward_std,
    split_groups,
)
from raygym.types import Sample


def group(*rewards) -> list[Sample]:
    return [
        Sample(prompt="p", prompt_tokens=[], group_index=0, sample_index=i, reward=r)
        for i, r in enumerate(rewards)
    ]


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        ((1.0, 1.0, 1.0), False),
        ((0.0, 0.0), False),
        ((0.0, 1.0), True),
        ((0.5, 0.5, 0.75), True),
        ((1.0,), False),
        ((0.3, 0.3 + 1e-9), False),
        ((None, 0.0), False),
        ((None, 1.0), True),
    ],
)
def test_uniform_groups_are_dropped(rewards, keep):
    assert drop_uniform_reward_groups(group(*rewards)) is keep
    assert nonzero_reward_std(group(*rewards)) is keep
    assert keep_all(group(*rewards)) is True


def test_load_group_filter_from_path_or_callable():
    assert load_group_filter(DEFAULT_FILTER_PATH) is drop_uniform_reward_groups
    assert load_group_filter("raygym.rollout.filters.keep_all") is keep_all
    assert load_group_filter(None) is None
    with pytest.raises(ConfigError, match="dynamic_sampling_filter_path"):
        load_group_filter("raygym.rollout.filters:missing")


def test_split_groups_contiguous():
    samples = group(0, 1, 2, 3, 4, 5)
    groups = split_groups(samples, 3)
    assert [[s.reward for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        split_groups(samples, 4)
