"""``raygym train --rollout-engine vllm`` on the tiny preset learns with vLLM's CPU build as its engine (its own
interpreter; the tiny model with head_dim 32, which vLLM's CPU attention needs), every weight sync verified
by the probe and the trainer-engine log-prob mismatch logged each step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def test_train_with_vllm_learns(tmp_path, vllm_python, vllm_model):
    out = tmp_path / "run"
    ray_tmp = tempfile.mkdtemp(prefix="rgv-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "raygym", "train", "--preset", "tiny", "--hf-checkpoint", vllm_model,
             "--rollout-engine", "vllm", "--rollout-engine-python", vllm_python, "--num-rollout", str(STEPS),
             "--output-dir", str(out)],
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
        # measured each step (fp32 or bf16 engine, fp32 trainer): small
        assert 0.0 <= r["rollout/logprob_mismatch_mean"] < 0.05 and r["rollout/logprob_mismatch_max"] < 1.0
    log = (out / "logs" / "server-0.log").read_text()
    assert "vLLM adapter ready" in log and "RAYGYM_ENGINE_API_KEY" not in log


def test_the_builtin_model_is_refused_before_anything_starts(tmp_path, vllm_python):
    """head_dim 16 (the builtin tiny model) is not a size vLLM's CPU attention runs: a ConfigError naming the
    fix, before Ray or the engine start."""
    run = subprocess.run(
        [sys.executable, "-m", "raygym", "train", "--rollout-engine", "vllm", "--rollout-engine-python", vllm_python,
         "--num-rollout", "1", "--output-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "head_dim=16" in run.stdout + run.stderr and "head_dim=32" in run.stdout + run.stderr
    assert "Started a local Ray instance" not in run.stdout + run.stderr
