"""``raygym train --lora-rank 8 --rollout-engine vllm`` learns with vLLM's CPU build serving the adapters (its
``LoRARequest``s, through raygym's adapter): every sync sends the adapters only, as a PEFT directory, and is
verified by the probe (whose requests name the adapter); the trainer-engine log-prob mismatch stays small, so the
engine generates with the trained adapter; the exported adapter is one ``peft`` loads. Short: 16 steps."""

from __future__ import annotations

import pytest

from tests.engine_training import train_with_engine

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 16


def test_lora_run_with_vllm_learns_with_every_sync_verified(tmp_path, vllm_python, vllm_model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows, log = train_with_engine(["--preset", "tiny", "--hf-checkpoint", vllm_model, "--rollout-engine", "vllm",
                                   "--rollout-engine-python", vllm_python, "--lora-rank", "8",
                                   "--num-rollout", str(STEPS)], tmp_path / "run")
    assert len(rows) == STEPS
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.08, f"mean reward first 5 steps {first:.3f}, last 5 {last:.3f}: {rewards}"
    adapter_bytes = rows[0]["sync/raw_bytes"]
    for r in rows:
        assert r["sync/verified_versions"] == 1.0 and r["sync/probe_tokens"] > 0, r
        assert r["sync/probe_logprob_diff_mean"] <= 0.05 and r["sync/full_resyncs"] == 0
        assert r["sync/raw_bytes"] == adapter_bytes < 200_000  # the adapters (rank 8), never the 0.3 MB base
        assert r["rollout/logprob_mismatch_mean"] < 0.05  # the engine generates with the trainer's adapters
    assert "vLLM adapter ready" in log
    hf = tmp_path / "run" / "hf"
    base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(hf))
    trained = [n for n, p in model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert len(trained) == 7 * 2 + 1  # q k v o gate up down in 2 layers, and lm_head (the tiny preset's targets)
