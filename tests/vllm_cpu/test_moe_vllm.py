"""Qwen3-MoE (``builtin:tiny-qwen3-moe``: 8 experts, top-2, head_dim 32) on vLLM's CPU build through raygym's
adapter: it generates what the HF model scores; weights from the torch backend (transformers 5's fused in-memory
expert tensors) reach it under the checkpoint's per-expert names, full over gloo and disk and as a delta over gloo,
each sync verified by the probe; vLLM's loader takes the fused names as well."""

from __future__ import annotations

import pytest

from raygym.builtin import TINY_MOE_MODEL, materialize_model
from raygym.engines.actor import EngineActor
from raygym.weightsync import moe_names
from raygym.weightsync.coordinator import WeightSync
from tests.vllm_cpu.test_vllm_engine import generate, hf_logprobs, recipe
from tests.weightsync.faults import FAULTS, OneExpertWrong, assert_one_wrong_expert_fails
from tests.weightsync.local_trainer import LocalTrainer

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return materialize_model(TINY_MOE_MODEL, tmp_path_factory.mktemp("vllm-moe-model"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(vllm_python, moe_model, tmp_path_factory):
    actor = EngineActor(recipe(vllm_python), engine_index=0, model_path=moe_model, gpu_ids=[], host="127.0.0.1",
                        backend="vllm", startup_timeout=600, log_dir=str(tmp_path_factory.mktemp("vllm-moe-logs")),
                        extra_server_args=["--dtype", "float32"])
    actor.start()
    yield actor
    actor.close()


def tolerance() -> float:
    """The engine runs in float32, so it serves the trainer's model to float32 rounding (in bf16, the experts
    scaled by 3 below would put bf16's own error beyond the probe's default tolerance)."""
    return 1e-3


def make_sync(engine, python, trainer, **over) -> WeightSync:
    sync = WeightSync(recipe(python, **over), [trainer], [engine.url()], engine_kind="vllm", session=True,
                      spec_overrides={"master_address": "127.0.0.1"})
    sync.setup()
    return sync


def move_experts(trainer: LocalTrainer) -> None:
    """A training step, then every expert weight scaled by 3: what the engine serves changes a lot, and only
    through the experts, so an engine whose experts did not load is caught."""
    import torch

    trainer.train_step()
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".mlp.experts." in name:
                p.mul_(3.0)


def serves(engine: EngineActor, trainer: LocalTrainer) -> float:
    """The largest difference between the engine's log-probs of its sample and the trainer's."""
    prompt = [3, 4, 5, 6]
    answer = generate(engine, [prompt], sampling_seed=11)[0]
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    want = trainer.probe_log_probs([prompt], [answer["output_ids"]])[0]
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def test_moe_generates_what_the_hf_model_scores(moe_engine, moe_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model).eval()
    prompts = [[3, 4, 5, 6], [10, 11, 12]]
    for prompt, answer in zip(prompts, generate(moe_engine, prompts, sampling_seed=3), strict=True):
        got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        want = hf_logprobs(model, prompt, answer["output_ids"])
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < tolerance(), (got, want)


@pytest.mark.parametrize("transport,mode", [("nccl", "full"), ("disk", "full"), ("nccl", "delta")])
def test_moe_sync_from_fused_in_memory_names_is_verified(moe_engine, vllm_python, moe_model, tmp_path, transport,
                                                         mode):
    trainer = LocalTrainer(moe_model, lr=2e-2)
    checkpoint = LocalTrainer(moe_model)
    sync = make_sync(moe_engine, vllm_python, trainer, update_weight_transport=transport, update_weight_mode=mode,
                     update_weight_disk_dir=str(tmp_path / "sync"))
    try:
        history = []
        for version in (1, 2):
            if version > 1:
                move_experts(trainer)
            history.append(sync.push(version))
            assert history[-1]["sync/full_resyncs"] == 0.0 and history[-1]["sync/verified_versions"] == 1.0
            assert serves(moe_engine, trainer) < tolerance()
        assert history[-1]["sync/mode"] == (1.0 if mode == "delta" else 0.0)
        assert serves(moe_engine, checkpoint) > 0.2  # the experts it serves are the trainer's new ones
    finally:
        sync.shutdown()


def test_vllm_takes_the_fused_names_too(moe_engine, vllm_python, moe_model, monkeypatch):
    """vLLM's Qwen3-MoE loader also takes transformers 5's fused expert names (what raygym sent before experts were
    converted at the sender): the experts arrive either way. (SGLang's does not: tests/sglang_cpu/test_moe_sglang.py.)"""
    monkeypatch.setitem(moe_names.EXPERT_LAYOUT, "vllm", moe_names.FUSED)
    trainer = LocalTrainer(moe_model, lr=2e-2)
    move_experts(trainer)
    sync = make_sync(moe_engine, vllm_python, trainer)
    try:
        assert sync.push(7)["sync/verified_versions"] == 1.0
        assert serves(moe_engine, trainer) < tolerance()
    finally:
        sync.shutdown()


@pytest.mark.parametrize("fault", FAULTS)
def test_one_wrong_expert_fails_the_calibrated_probe(moe_engine, vllm_python, moe_model, fault):
    """float32: the probe, calibrated at the first sync, sees one expert of one layer wrong; honest syncs pass."""
    trainer = OneExpertWrong(moe_model, lr=1e-3)
    sync = make_sync(moe_engine, vllm_python, trainer)
    try:
        assert_one_wrong_expert_fails(sync, trainer, fault, "vLLM")
    finally:
        sync.shutdown()
