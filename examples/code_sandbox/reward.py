"""The code example's reward: tests passed by the completed ``f=lambda x:...``, run in raygym's sandbox
(two sandbox actors, 2 CPU-seconds and 5 s per run).

A tiny model starts out writing random characters, which almost never compile, so the reward also
pays a little for getting there: 0.05 when the body starts with the argument ``x``, 0.15
times the fraction of tests whose call of ``f`` ran (passed, or returned a wrong value, rather than
raising: a lambda body is only evaluated when called), and 0.8 times the fraction of tests passed.
``raygym.sandbox.reward:code_reward`` is the plain version (the fraction of tests passed).
"""

from __future__ import annotations

from raygym.sandbox.isolation import Limits
from raygym.sandbox.reward import CodeReward
from raygym.types import Sample

PREFIX = "f=lambda x:"
tests_passed = CodeReward(prefix=PREFIX, pool_size=2, limits=Limits(cpu_seconds=2, wall_seconds=5.0))


def score(sample: Sample) -> float:
    """0.05 format + 0.15 x tests that ran + 0.8 x tests passed (see the module docs)."""
    body = sample.response_text.strip()
    fraction = tests_passed(sample)  # also records code_tests_passed / code_tests_ran in sample.metrics
    starts_right = 0.05 if body.startswith("x") else 0.0
    return starts_right + 0.15 * sample.metrics["code_tests_ran"] + 0.8 * fraction
