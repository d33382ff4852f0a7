"""examples/reasoning_gym, openenv_env and verifiers_env: each README's commands run for a few steps (two
reasoning-gym tasks, an OpenEnv server, a verifiers environment) and report their rewards and episode metrics."""

from __future__ import annotations

import json

import pytest
from readme_runner import run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SHORT = ["--num-rollout", "3", "--rollout-batch-size", "4", "--global-batch-size", "32", "--no-eval-interval"]


def test_reasoning_gym_example_trains_two_tasks_scored_by_their_scorers(tmp_path):
    pytest.importorskip("reasoning_gym")
    chain_sum = run_example("reasoning_gym", tmp_path, train_flags=SHORT)
    letters = [json.loads(r) for r in (tmp_path / "run-reasoning_gym" / "metrics.jsonl").read_text().splitlines()]
    for rows in (letters, chain_sum):
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(r["rollout/reward_errors"] == 0 and 0.0 <= r["rollout/reward/reasoning_gym"] <= 1.0 for r in rows)
    config = json.loads((tmp_path / "reasoning_gym_chain_sum" / "config.json").read_text())
    assert config["dataset"]["prompt_data"].startswith("reasoning-gym:chain_sum")


def test_openenv_example_plays_episodes_on_its_server(tmp_path):
    pytest.importorskip("openenv.core")
    rows = run_example("openenv_env", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["rollout/env_turns"] == 3.0 and r["rollout/env_errors"] == 0.0  # three questions, every episode
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0 and r["rollout/reward_errors"] == 0


def test_verifiers_example_is_scored_by_its_rubric(tmp_path):
    pytest.importorskip("verifiers")
    rows = run_example("verifiers_env", tmp_path, train_flags=SHORT)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["rollout/env_turns"] == 3.0 and r["rollout/env_errors"] == 0.0
        assert r["rollout/verifiers/counting_score"] == pytest.approx(r["rollout/reward_mean"])
        assert r["rollout/reward_errors"] == 0
