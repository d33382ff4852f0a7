"""The default run learns: ``raygym train`` with the tiny preset's defaults (its own local Ray, the
built-in model and task), shortened to 50 steps for CI, must raise the mean reward of its last 10
steps well above that of its first 10, print a progress line per step and a summary table, and leave
the reward-curve PNG and the metrics file in its run directory.

(The README run is the full preset: >= +0.3 over 100 steps in under 5 minutes on 2 cores; measured
+0.46 in 1:57 here.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 50


def test_raygym_train_defaults_learn(tmp_path):
    out = tmp_path / "run"
    ray_tmp = tempfile.mkdtemp(prefix="rgd-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, like a user's first run
    try:
        run = subprocess.run(
            [sys.executable, "-m", "raygym", "train", "--num-rollout", str(STEPS), "--output-dir", str(out)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-4000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.2, f"mean reward first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    # it learned the task, not just something: the answers got shorter (stop after the digit)
    assert sum(r["rollout/response_len_mean"] for r in rows[-10:]) < sum(r["rollout/response_len_mean"] for r in rows[:10])

    for step in (0, STEPS - 1):  # one numbering, from 0, as in metrics.jsonl; [done/total] beside it
        assert f"step {step} [{step + 1}/{STEPS}]" in printed
    assert "rollout/reward_mean" in printed  # the summary table
    png = out / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.json").exists() and (out / "hf" / "config.json").exists()
