"""``raygym train --rollout-engine sglang`` on the tiny preset learns with stock SGLang as its engine (CPU
backend, its own interpreter), every weight sync verified by the probe; the default engine is unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def test_train_with_stock_sglang_learns(tmp_path, sglang_python):
    out = tmp_path / "run"
    ray_tmp = tempfile.mkdtemp(prefix="rgs-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "raygym", "train", "--rollout-engine", "sglang", "--rollout-engine-python",
             sglang_python, "--num-rollout", str(STEPS), "--output-dir", str(out)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1400)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.15, f"mean reward first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    for r in rows:  # every sync was checked against the trainer, none silently unverified
        assert r["sync/verified_versions"] == 1.0 and r["sync/probe_tokens"] > 0, r
        assert r["sync/probe_logprob_diff_mean"] <= 0.1
    log = (out / "logs" / "server-0.log").read_text()
    assert "sglang" in log.lower() and "RAYGYM_ENGINE_API_KEY" not in log
