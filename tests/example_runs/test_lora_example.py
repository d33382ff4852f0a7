"""examples/lora: the README's commands (train, export the adapter, export the merged model) run for a few steps;
only the adapters are synced, each verified, and both exports load (the adapter with ``peft``)."""

from __future__ import annotations

import pytest
from readme_runner import run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_lora_example_syncs_only_verified_adapters_and_exports_them(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = run_example("lora", tmp_path, train_flags=["--num-rollout", "3", "--save-interval", "3"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["sync/verified_tensors"] == 30 and r["sync/raw_bytes"] == 69184  # 15 adapted modules x (A, B), fp32
        assert r["rollout/logprob_mismatch_mean"] < 1e-5 and r["rollout/reward_errors"] == 0
    base_dir = tmp_path / "lora" / "cache" / "models" / "tiny-qwen3-seed0"
    ids = torch.tensor([[15, 16, 17, 18, 19]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                            str(tmp_path / "lora-adapter")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora-merged", dtype=torch.float32)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert (adapted - base).abs().max() > 1e-3  # three steps of training moved the adapters
