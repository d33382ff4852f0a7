"""Qwen3-MoE (``builtin:tiny-qwen3-moe``: 8 experts, top-2) on stock SGLang's CPU backend: it generates what the
HF model scores; weights from the torch backend (transformers 5's fused in-memory expert tensors) reach it under
the checkpoint's per-expert names, full over gloo and disk and as a delta through the custom loader, each sync
verified by the probe; the fused names themselves (what raygym sent before) fail that probe, and so does one expert
sent one step stale or scaled by 1.01. Routing replay: the
flag raygym adds is SGLang's own (parsed by every release that has it); its CPU backend dies capturing routed
experts (pinned host memory), shown by launching it, so a replay run on CPU stops before Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygym.builtin import TINY_MOE_MODEL, materialize_model
from raygym.config import Recipe
from raygym.engines.actor import EngineActor
from raygym.engines.launch.sglang import SUPPORTED_SGLANG, build_sglang_argv
from raygym.errors import ConfigError, WeightSyncError
from raygym.weightsync import moe_names
from raygym.weightsync.transport_dist import free_port
from tests.sglang_cpu.test_launch_flags import parse_with_sglang
from tests.sglang_cpu.test_sglang_engine import (
    assert_serves_trainer,
    generate,
    hf_logprobs,
    make_sync,
    recipe,
)
from tests.weightsync.faults import FAULTS, OneExpertWrong, assert_one_wrong_expert_fails
from tests.weightsync.local_trainer import LocalTrainer

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.timeout(1200)]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return materialize_model(TINY_MOE_MODEL, tmp_path_factory.mktemp("sglang-moe-model"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(sglang_python, moe_model, tmp_path_factory):
    # float32 (SGLang's 'auto' would serve this float32 checkpoint in float16, whose noise hides one expert 1% off)
    actor = EngineActor(recipe(sglang_python), engine_index=0, model_path=moe_model, gpu_ids=[], host="127.0.0.1",
                        backend="sglang", startup_timeout=600, log_dir=str(tmp_path_factory.mktemp("sglang-moe-logs")),
                        extra_server_args=["--dtype", "float32"])
    actor.start()
    yield actor
    actor.close()


def test_moe_generates_what_the_hf_model_scores(moe_engine, moe_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model).eval()
    prompts = [[3, 4, 5, 6], [10, 11, 12]]
    for prompt, answer in zip(prompts, generate(moe_engine, prompts, sampling_seed=3), strict=True):
        tokens = answer["output_ids"]
        got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
        want = hf_logprobs(model, prompt, tokens)
        assert len(tokens) == 6 and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.05, (got, want)


def move_experts(trainer: LocalTrainer) -> None:
    """A training step, then every expert weight scaled by 3: what the engine serves changes a lot, and only
    through the experts, so an engine whose experts did not load is caught."""
    import torch

    trainer.train_step()
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if ".mlp.experts." in name:
                p.mul_(3.0)


def checkpoint_distance(engine, moe_model: str) -> float:
    """How far the engine's log-probs of its own sample are from the checkpoint model's (large once the experts
    moved and arrived)."""
    prompt = [3, 4, 5, 6]
    answer = generate(engine, [prompt], sampling_seed=11)[0]
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    want = LocalTrainer(moe_model).probe_log_probs([prompt], [answer["output_ids"]])[0]
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_moe_full_sync_from_fused_in_memory_names_is_verified(moe_engine, sglang_python, moe_model, tmp_path,
                                                              transport):
    trainer = LocalTrainer(moe_model, lr=2e-2)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in trainer.hf_weights())  # transformers 5 fuses
    sync = make_sync(moe_engine, sglang_python, trainer, update_weight_transport=transport,
                     update_weight_disk_dir=str(tmp_path / "sync"))
    try:
        for version in (1, 2):
            if version > 1:
                move_experts(trainer)
            metrics = sync.push(version)
            assert metrics["sync/full_resyncs"] == 0.0 and metrics["sync/verified_versions"] == 1.0
            assert metrics["sync/probe_logprob_diff_mean"] <= 0.1
            assert_serves_trainer(moe_engine, trainer, version)
        assert checkpoint_distance(moe_engine, moe_model) > 0.2  # the experts it serves are the trainer's new ones
    finally:
        sync.shutdown()


def test_fused_names_do_not_reach_sglangs_experts(moe_engine, sglang_python, moe_model, tmp_path, monkeypatch):
    """The names raygym sent before experts were converted at the sender: SGLang's Qwen3-MoE loader skips them
    without a word (no parameter has that name), the experts keep their old weights and the probe fails the sync."""
    reset = make_sync(moe_engine, sglang_python, LocalTrainer(moe_model), update_weight_transport="disk",
                      update_weight_disk_dir=str(tmp_path / "reset"))
    reset.push(1)  # the engine holds the checkpoint again
    reset.shutdown()
    monkeypatch.setitem(moe_names.EXPERT_LAYOUT, "sglang", moe_names.FUSED)  # the old code path: no conversion
    trainer = LocalTrainer(moe_model, lr=2e-2)
    move_experts(trainer)
    sync = make_sync(moe_engine, sglang_python, trainer, update_weight_transport="nccl")
    try:
        with pytest.raises(WeightSyncError):
            sync.push(2)
    finally:
        sync.shutdown()


@pytest.mark.parametrize("fault", FAULTS)
def test_one_wrong_expert_fails_the_calibrated_probe(moe_engine, sglang_python, moe_model, fault):
    """One expert of one layer sent one step stale, or scaled by 1.01, fails the probe calibrated at the first
    sync; the honest syncs around it pass."""
    trainer = OneExpertWrong(moe_model, lr=1e-3)
    sync = make_sync(moe_engine, sglang_python, trainer)
    try:
        assert_one_wrong_expert_fails(sync, trainer, fault, "SGLang")
    finally:
        sync.shutdown()


def test_moe_delta_over_disk_through_the_custom_loader(moe_engine, sglang_python, moe_model, tmp_path):
    trainer = LocalTrainer(moe_model, lr=1e-6)
    sync = make_sync(moe_engine, sglang_python, trainer, cast_dtype="bfloat16", update_weight_transport="disk",
                     update_weight_mode="delta", update_weight_disk_dir=str(tmp_path / "sync"))
    try:
        history = []
        for version in (1, 2):
            if version > 1:
                trainer.train_step()
            history.append(sync.push(version))
            assert_serves_trainer(moe_engine, trainer, version)
        assert [m["sync/mode"] for m in history] == [0.0, 1.0]
        assert all(m["sync/full_resyncs"] == 0.0 for m in history)
    finally:
        sync.shutdown()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_sglangs_parser_takes_the_routing_replay_flag(version, sglang_python):
    from tests.sglang_cpu.conftest import sglang_home

    gpu = Recipe(rollout_num_gpus_per_engine=1, actor_num_gpus_per_node=8, use_rollout_routing_replay=True)
    if version == "0.5.6":  # the flag arrived in 0.5.15
        with pytest.raises(ConfigError, match="arrived in 0.5.15"):
            build_sglang_argv(gpu, model_path="/ckpt", host="10.0.0.2", port=30000, sglang_version=version)
        return
    argv = build_sglang_argv(gpu, model_path="/ckpt", host="10.0.0.2", port=30000, sglang_version=version)
    [parsed] = parse_with_sglang(sglang_python, sglang_home(), version, [argv[3:]])
    assert parsed["enable_return_routed_experts"] is True


@pytest.mark.timeout(600)
def test_sglangs_cpu_backend_dies_capturing_routed_experts(sglang_python, moe_model, tmp_path):
    """Why raygym refuses routing replay on SGLang's CPU backend, shown: launched with
    --enable-return-routed-experts, it exits while it allocates the capture's pinned host buffer."""
    cpu = Recipe(rollout_engine="sglang", colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                 rollout_max_response_len=8, eval_interval=None)
    argv = build_sglang_argv(cpu, model_path=moe_model, host="127.0.0.1", port=free_port("127.0.0.1"),
                             python=sglang_python, sglang_version="0.5.18", device="cpu", custom_weight_loaders=(),
                             skip_server_warmup=True, extra_args=["--enable-return-routed-experts"])
    log = tmp_path / "sglang.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
        try:
            code = proc.wait(timeout=540)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert "state_capturer" in text and "NVIDIA driver" in text, text[-3000:]


@pytest.mark.timeout(300)
def test_routing_replay_on_sglangs_cpu_backend_stops_before_ray(sglang_python, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "raygym", "train", "--hf-checkpoint", TINY_MOE_MODEL,
                           "--use-rollout-routing-replay", "--rollout-engine", "sglang", "--rollout-engine-python",
                           sglang_python, "--output-dir", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "stock SGLang returns routed experts on GPU only" in done.stderr and "--rollout-engine raygym" in done.stderr
