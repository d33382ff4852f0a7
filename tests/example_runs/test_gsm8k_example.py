"""examples/gsm8k: the README's prepare + train commands run (a few steps) and score sensibly."""

from __future__ import annotations

import json

import pytest
from readme_runner import run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_gsm8k_example_runs_from_its_readme(tmp_path):
    rows = run_example("gsm8k", tmp_path, train_flags=["--num-rollout", "4", "--eval-interval", "2"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)
    assert all(r["rollout/reward_errors"] == 0 for r in rows)  # the example's reward imports and runs
    assert "eval/gsm8k/reward_mean" in rows[1]
    stats = json.loads((tmp_path / "gsm8k-data" / "stats.json").read_text())
    assert stats["train_rows"] == 5 and stats["eval_rows"] == 1
