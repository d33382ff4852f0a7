"""``raygym train --rollout-engine vllm`` on the tiny preset learns with vLLM's CPU build as its engine (its own
interpreter; the tiny model with head_dim 32, which vLLM's CPU attention needs), every weight sync verified
by the probe and the trainer-engine log-prob mismatch logged each step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.engine_training import (
    REPO_ROOT,
    assert_learns_with_probe_verified_syncs,
    installed_raygym_python,
    train_with_engine,
)

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 40


def test_train_with_vllm_learns(tmp_path, vllm_python, vllm_model):
    """raygym from its wheel in a fresh venv (as users install it): vLLM's interpreter imports its own packages."""
    python = installed_raygym_python(tmp_path / "wheel")
    rows, log = train_with_engine(["--preset", "tiny", "--hf-checkpoint", vllm_model, "--rollout-engine", "vllm",
                                   "--rollout-engine-python", vllm_python, "--num-rollout", str(STEPS)],
                                  tmp_path / "run", python=python)
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    for r in rows:  # measured each step (fp32 or bf16 engine, fp32 trainer): small
        assert 0.0 <= r["rollout/logprob_mismatch_mean"] < 0.05 and r["rollout/logprob_mismatch_max"] < 1.0
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


def test_fully_async_with_vllm_learns_within_the_staleness_bound(tmp_path, vllm_python, vllm_model):
    """--fully-async on vLLM: generation runs ahead up to --max-staleness steps; what a sync aborts is continued
    on the new weights; no sample is trained past the bound."""
    rows, _ = train_with_engine(["--preset", "tiny", "--hf-checkpoint", vllm_model, "--rollout-engine", "vllm",
                                 "--rollout-engine-python", vllm_python, "--fully-async", "--max-staleness", "2",
                                 "--use-tis", "--num-rollout", str(STEPS)], tmp_path / "run")
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in rows)
    assert max(r["rollout/staleness_max"] for r in rows) >= 1


def test_tiny_moe_learns_with_vllm(tmp_path, vllm_python):
    """builtin:tiny-qwen3-moe (8 experts, top-2, head_dim 32) from the torch backend: its fused in-memory expert
    tensors reach vLLM's Qwen3-MoE loader under the checkpoint's per-expert names, every sync verified by the
    probe. (vLLM returns no routed experts, so routing replay is refused before Ray: raygym.engine_api.kinds.)"""
    rows, _ = train_with_engine(["--hf-checkpoint", "builtin:tiny-qwen3-moe", "--rollout-engine", "vllm",
                                 "--rollout-engine-python", vllm_python, "--num-rollout", str(STEPS)],
                                tmp_path / "run")
    assert_learns_with_probe_verified_syncs(rows, STEPS)


def test_the_tiny_vlm_learns_to_count_with_vllm(tmp_path, vllm_python):
    """examples/vision's run with vLLM as the engine: the images reach vLLM through raygym's adapter, every sync
    of the vision tower and language model is verified, and the held-out count is learned (chance: 0.25)."""
    rows, _ = train_with_engine(["@", str(REPO_ROOT / "examples" / "vision" / "run.toml"), "--rollout-engine", "vllm",
                                 "--rollout-engine-python", vllm_python], tmp_path / "run")
    assert len(rows) == 120 and all(r["sync/verified_tensors"] == 57 and r["sync/probe_image_tokens"] == 50 for r in rows)
    early = sum(r["rollout/reward_mean"] for r in rows[:10]) / 10  # the random model rarely answers a digit (about 0.06)
    evals = [r["eval/count-shapes/pass@1"] for r in rows if "eval/count-shapes/pass@1" in r]
    assert early < 0.3 and evals[-1] > 0.6, (early, evals)
