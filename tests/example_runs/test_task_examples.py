"""examples/calculator, code_sandbox, haiku_judge and distillation: each README's commands run for a few
steps and report the metrics their capability adds."""

from __future__ import annotations

import pytest
from readme_runner import run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SHORT = ["--num-rollout", "3", "--rollout-batch-size", "4", "--global-batch-size", "32", "--no-eval-interval"]


def test_calculator_example_runs_episodes_with_the_tool(tmp_path):
    rows = run_example("calculator", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 1.0 <= r["rollout/env_turns"] <= 3.0
        assert 0.0 <= r["rollout/env_tool_errors"] <= r["rollout/env_tool_calls"]
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0 and r["rollout/reward_errors"] == 0


def test_code_example_scores_in_the_sandbox(tmp_path):
    rows = run_example("code_sandbox", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["rollout/reward_errors"] == 0  # every sample went through the sandbox
        assert 0.0 <= r["rollout/code_tests_passed"] <= r["rollout/code_loaded"] <= 1.0


def test_haiku_example_is_scored_by_the_judge_group(tmp_path):
    rows = run_example("haiku_judge", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["judge/requests"] + r["judge/cache_hits"] == 32  # every sample judged once or cached
        assert r["judge/errors"] == 0 and r["judge/batches"] >= 1
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0


def test_distillation_example_scores_with_the_teacher(tmp_path):
    rows = run_example("distillation", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["rollout/distill_reverse_kl"] > 0.0 for r in rows)  # a random student vs a trained teacher
    assert (tmp_path / "distill-teacher" / "hf" / "config.json").exists()
