"""The training loop on the Megatron backend (its CPU mode), driven by ``raygym train`` flags on the tiny
preset: synchronous with the KL loss and a checkpoint every step, resumed from it with ``--load`` in
async mode, and colocated with two tensor-parallel ranks; every run exports the final weights to HF.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raygym.checkpoint.store import latest_checkpoint, list_checkpoints, load_checkpoint
from raygym.config import megatron_installed
from raygym.run.config_loading import load_train_config

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.megatron,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not megatron_installed(), reason="megatron-core is not installed (pip install 'raygym[megatron]')"),
]

# The tiny preset shrunk to one optimizer step of 16 samples per rollout.
SMALL = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--seed", "7"]
KL = ["--use-kl-loss", "--kl-loss-coef", "0.05"]


def run(out: Path, *flags: str):
    from raygym.run.driver import train

    cfg = load_train_config(["--trainer-backend", "megatron", *SMALL, "--output-dir", str(out), *flags])
    return train(cfg)


def rows(result) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, Path(result.metrics_path).read_text().splitlines())}


def test_sync_with_kl_saves_then_resumes_async(ray_local, tmp_path):
    first = run(tmp_path / "a", *KL, "--num-rollout", "2", "--save-interval", "1")
    assert first.final_step == 1
    a = rows(first)
    for step in (0, 1):
        assert a[step]["train/kl_loss"] >= 0.0 and a[step]["train/grad_norm"] > 0
        assert a[step]["sync/full_resyncs"] == 0  # the engine holds exactly the trainer's weights
    assert a[1]["train/kl_loss"] > 0.0  # the policy left the reference after step 0
    save = str(tmp_path / "a" / "checkpoints")
    assert [c.rollout_id for c in list_checkpoints(save)] == [0, 1]
    info = latest_checkpoint(save)
    assert info.manifest["format"] == "raygym-checkpoint/2" and info.manifest["has_optimizer"]
    assert first.hf_export_path and (Path(first.hf_export_path) / "model.safetensors").exists()

    resumed = run(tmp_path / "a", *KL, "--num-rollout", "4", "--save-interval", "2", "--load", save,
                  "--async-mode")
    assert [r["step"] for r in resumed.steps] == [2, 3]  # continued after the newest checkpoint
    b = rows(resumed)
    assert b[3]["rollout/staleness_max"] == 1 and b[3]["train/kl_loss"] > 0.0
    assert latest_checkpoint(save).rollout_id == 3
    extra = load_checkpoint(latest_checkpoint(save).path, load_optimizer=False).extra
    assert extra["data_state"]["train"]["offset"] == 16  # 4 steps x 4 prompts consumed


def test_colocated_tensor_parallel_with_kl(ray_local, tmp_path):
    result = run(tmp_path, *KL, "--num-rollout", "2", "--save-interval", "2", "--colocate",
                 "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--tensor-model-parallel-size", "2")
    assert result.final_step == 1
    r = rows(result)
    assert all(r[s]["sync/full_resyncs"] == 0 and r[s]["sync/engines"] == 2 for s in (0, 1))
    assert r[1]["train/kl_loss"] > 0.0
    order = [e.split(":", 1)[1] for e in result.events if e.startswith("1:")]
    assert order == ["engines.release", "trainers.onload", "train", "trainers.offload", "engines.resume_weights",
                     "sync", "engines.resume_kv_cache"]
    info = latest_checkpoint(str(tmp_path / "checkpoints"))
    assert info.manifest["world_size"] == 2
    # the two tensor-parallel ranks' shards read back whole: the very tensors of the final HF export
    import torch
    from safetensors.torch import load_file

    saved = load_checkpoint(info.path, load_optimizer=False).model_state
    exported = load_file(str(Path(result.hf_export_path) / "model.safetensors"))
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[n], exported[n]) for n in saved)


def test_moe_expert_parallel_with_routing_replay(ray_local, tmp_path):
    """builtin:tiny-qwen3-moe (8 experts, top-2) on two Megatron ranks with expert parallelism 2 (4 whole experts
    per rank: the 30B-A3B recipe's experts-per-rank split, scaled down; Megatron's MoE tensor parallelism needs
    sequence parallelism, a GPU layout), replaying the engine's routes in every forward pass."""
    result = run(tmp_path, "--hf-checkpoint", "builtin:tiny-qwen3-moe", "--num-rollout", "3", "--save-interval", "3",
                 "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                 "--expert-model-parallel-size", "2", "--use-rollout-routing-replay")
    assert result.final_step == 2
    r = rows(result)
    for step in (0, 1, 2):
        assert r[step]["sync/full_resyncs"] == 0 and r[step]["sync/verified_tensors"] > 0  # per-expert names arrived
        assert r[step]["train/grad_norm"] > 0 and r[step]["train/routing_replay_tokens"] > 0
        assert r[step]["train/routing_replay_differ_decision_frac"] <= 0.05  # Megatron's routers vs the engine's
    assert latest_checkpoint(str(tmp_path / "checkpoints")).manifest["world_size"] == 2
