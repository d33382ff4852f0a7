"""``raygym train --rollout-engine sglang`` on the tiny preset learns with stock SGLang as its engine (CPU
backend, its own interpreter), every weight sync verified by the probe; raygym is installed from its wheel into
a fresh venv made from the same base Python as SGLang's (as users install it), so SGLang must import its own
packages, never the trainer's."""

from __future__ import annotations

import os

import pytest

from tests.engine_training import (
    REPO_ROOT,
    assert_learns_with_probe_verified_syncs,
    installed_raygym_python,
    train_with_engine,
)

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 40


def test_train_with_stock_sglang_learns(tmp_path, sglang_python):
    python = installed_raygym_python(tmp_path / "wheel")
    rows, log = train_with_engine(["--rollout-engine", "sglang", "--rollout-engine-python", sglang_python,
                                   "--num-rollout", str(STEPS)], tmp_path / "run", python=python)
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    assert "sglang" in log.lower() and "RAYGYM_ENGINE_API_KEY" not in log


def test_fully_async_with_stock_sglang_learns_within_the_staleness_bound(tmp_path, sglang_python):
    """--fully-async on stock SGLang: generation runs ahead up to --max-staleness steps, every sync's pause aborts
    what is in flight and raygym continues it on the new weights; no sample is trained past the bound."""
    rows, log = train_with_engine(["--rollout-engine", "sglang", "--rollout-engine-python", sglang_python,
                                   "--fully-async", "--max-staleness", "2", "--use-tis", "--num-rollout", str(STEPS)],
                                  tmp_path / "run")
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    assert all(0 <= r["rollout/staleness_max"] <= 2 for r in rows)
    assert max(r["rollout/staleness_max"] for r in rows) >= 1
    if len(os.sched_getaffinity(0)) >= 2:  # cpu_placement="disjoint": the engine on the last core
        last = max(os.sched_getaffinity(0))
        assert f"raygym: sglang pinned to cores {last} (SGLANG_CPU_OMP_THREADS_BIND={last})" in log, log[:3000]


def test_tiny_moe_learns_with_stock_sglang(tmp_path, sglang_python):
    """builtin:tiny-qwen3-moe (8 experts, top-2) from the torch backend: its fused in-memory expert tensors reach
    SGLang's Qwen3-MoE loader under the checkpoint's per-expert names, every sync verified by the probe. (Routing
    replay on SGLang's CPU backend is refused before Ray starts: tests/sglang_cpu/test_moe_sglang.py.)"""
    rows, _ = train_with_engine(["--hf-checkpoint", "builtin:tiny-qwen3-moe", "--rollout-engine", "sglang",
                                 "--rollout-engine-python", sglang_python, "--num-rollout", str(STEPS)],
                                tmp_path / "run")
    assert_learns_with_probe_verified_syncs(rows, STEPS)


def test_the_tiny_vlm_learns_to_count_with_stock_sglang(tmp_path, sglang_python):
    """examples/vision's run with stock SGLang as the engine: each image's pads reach SGLang as the one it widens
    itself, the tower and language model sync under the checkpoint's names, verified, and the count is learned."""
    rows, _ = train_with_engine(["@", str(REPO_ROOT / "examples" / "vision" / "run.toml"), "--rollout-engine",
                                 "sglang", "--rollout-engine-python", sglang_python], tmp_path / "run")
    assert len(rows) == 120  # every sync verified, its probe scoring the text after an image too (the tower)
    assert all(r["sync/verified_versions"] == 1.0 and r["sync/probe_image_tokens"] == 50 for r in rows)
    early = sum(r["rollout/reward_mean"] for r in rows[:10]) / 10  # the random model rarely answers a digit (about 0.06)
    evals = [r["eval/count-shapes/pass@1"] for r in rows if "eval/count-shapes/pass@1" in r]
    assert early < 0.3 and evals[-1] > 0.6, (early, evals)
