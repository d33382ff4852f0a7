"""raygym against vLLM (its CPU build, its own interpreter) through raygym's adapter: generation and log-probs
through raygym's client, pause/abort/continue/flush, release/resume, verified weight syncs over gloo and disk
(full, and delta through the workers' host snapshot), a sync that fails and resyncs, an engine restart, the
API key."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from raygym.config import Recipe
from raygym.engine_api.auth import use_engine_api_key
from raygym.engine_api.protocol import Endpoint, GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.engines.vllm.server import cpu_dtype
from raygym.errors import WeightSyncError
from raygym.weightsync.coordinator import WeightSync
from tests.vllm_cpu.conftest import LONG_CONTEXT
from tests.weightsync.faults import (
    ATTENTION_TENSOR,
    FAULTS,
    MLP_TENSOR,
    FaultyTrainer,
    TamperingLink,
    syncs_for,
)
from tests.weightsync.local_trainer import LocalTrainer

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(1500)]
API_KEY = "vllm-cpu-test-key"


def recipe(python: str, **over) -> Recipe:
    fields = dict(rollout_engine="vllm", rollout_engine_python=python, colocate=False, actor_num_gpus_per_node=1,
                  rollout_num_gpus=1, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8,
                  rollout_max_response_len=LONG_CONTEXT - 16, rollout_max_prompt_len=16, eval_interval=None,
                  update_weight_timeout=120.0, update_weight_buffer_size=64 * 1024)
    fields.update(over)
    return Recipe(**fields)


@pytest.fixture(scope="module")
def engine(vllm_python, vllm_model, tmp_path_factory):
    use_engine_api_key(API_KEY)
    actor = EngineActor(recipe(vllm_python), engine_index=0, model_path=vllm_model, gpu_ids=[], host="127.0.0.1",
                        backend="vllm", startup_timeout=600, log_dir=str(tmp_path_factory.mktemp("vllm-logs")))
    actor.start()
    yield actor
    actor.close()


def generate(engine: EngineActor, prompts: list[list[int]], **params) -> list[dict]:
    return engine.generate(GenerateRequest(input_ids=prompts, return_logprob=True, logprob_start_len=0, sampling_params={
        "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "spaces_between_special_tokens": False, **params}))


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def test_generate_with_logprobs_through_raygyms_client(engine, vllm_model):
    from transformers import AutoModelForCausalLM

    info = engine.engine_info()
    assert info["kind"] == "vllm" and info["version"] == "0.32.0" and info["device"] == "cpu"
    # a float32 checkpoint stays float32 on a CPU without bf16 instructions, else vLLM runs it in bf16
    flags = Path("/proc/cpuinfo").read_text()
    assert info["dtype"] == ("float32" if cpu_dtype("auto", "float32", flags) == "float32" else "bfloat16")
    prompts = [[3, 4, 5, 6], [10, 11, 12]]
    out = generate(engine, prompts, sampling_seed=7)
    assert isinstance(out, list) and len(out) == 2
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()
    for prompt, answer in zip(prompts, out, strict=True):
        meta = answer["meta_info"]
        tokens = [t for _, t, _ in meta["output_token_logprobs"]]
        assert tokens == answer["output_ids"] and len(tokens) == 6
        assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "0"
        assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == len(prompt)
        got = [lp for lp, _, _ in meta["output_token_logprobs"]]
        want = hf_logprobs(model, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.02, (got, want)
        got_prompt = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
        want_prompt = hf_logprobs(model, prompt[:1], prompt[1:])
        assert max(abs(a - b) for a, b in zip(got_prompt, want_prompt, strict=True)) < 0.02
    # the same seed samples the same tokens; temperature scales the reported log-probs as the trainer does
    again = generate(engine, prompts[:1], sampling_seed=7)[0]
    assert again["output_ids"] == out[0]["output_ids"]
    cold = generate(engine, prompts[:1], sampling_seed=3, temperature=0.7)[0]
    want = hf_logprobs(model, prompts[0], cold["output_ids"], temperature=0.7)
    got = [lp for lp, _, _ in cold["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.02
    info = engine.call(Endpoint.MODEL_INFO)
    assert info["weight_version"] == "0" and info["has_image_understanding"] is False


def test_stop_tokens_and_unknown_sampling_fields(engine):
    greedy = generate(engine, [[3, 4, 5]], temperature=0.0, max_new_tokens=8)[0]
    stop_at = greedy["output_ids"][2]
    stopped = generate(engine, [[3, 4, 5]], temperature=0.0, max_new_tokens=8, stop_token_ids=[stop_at])[0]
    assert stopped["output_ids"] == greedy["output_ids"][: greedy["output_ids"].index(stop_at) + 1]
    assert stopped["meta_info"]["finish_reason"].model_dump(exclude_unset=True) == {"type": "stop", "matched": stop_at}
    with pytest.raises(Exception, match="regex"):
        generate(engine, [[3, 4]], regex="a+")


def test_every_route_needs_the_api_key_but_health(engine):
    url = engine.url()
    assert httpx.post(f"{url}/generate", json={"input_ids": [1, 2]}, timeout=30).status_code == 401
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/tmp"}, timeout=30).status_code == 401
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert API_KEY not in engine.log_tail(100_000)


def test_pause_abort_continue_flush_release_resume(engine):
    # requests in flight are returned, aborted, by a pause in "abort" mode; decoding to the end of the context
    # keeps the batch running for seconds (at 240 tokens it was done in 1 s, between two answers of a busy adapter)
    result: dict = {}
    long = [[5, 6 + i % 20] for i in range(32)]
    thread = threading.Thread(target=lambda: result.update(out=generate(engine, long, max_new_tokens=LONG_CONTEXT - 8)))
    thread.start()
    deadline = time.monotonic() + 60
    seen = []
    with stats_client() as client:
        while (running := stats(engine, client)["running"]) < len(long) and time.monotonic() < deadline:
            seen.append(running)
            time.sleep(0.02)
    # all of them in flight at the pause; else the batch may finish first and nothing is left to abort
    assert running == len(long), f"only {max(seen, default=0)} of {len(long)} requests were ever in flight: {seen[-20:]}"
    assert engine.call(Endpoint.PAUSE_GENERATION, mode="abort")["status"] == "ok"
    thread.join(60)
    reasons = [a["meta_info"]["finish_reason"]["type"] for a in result["out"]]
    assert "abort" in reasons, reasons
    assert stats(engine)["running"] == 0 and stats(engine)["paused"]
    assert engine.flush_cache() is True
    assert not engine.health_generate(timeout=5)  # paused: the probe waits in line (as on SGLang), unanswered
    engine.call(Endpoint.CONTINUE_GENERATION)
    assert len(generate(engine, [[5, 6]])[0]["output_ids"]) == 6
    engine.call(Endpoint.RELEASE_MEMORY)
    assert not engine.health_generate(timeout=5)
    engine.call(Endpoint.RESUME_MEMORY)
    assert engine.health_generate(timeout=30)
    assert len(generate(engine, [[5, 6]])[0]["output_ids"]) == 6


def stats_client() -> httpx.Client:
    return httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)


def stats(engine: EngineActor, client: httpx.Client | None = None) -> dict:
    """The adapter's ``/raygym/stats``: requests in flight, paused, released."""
    if client is None:
        with stats_client() as own:
            return own.get(f"{engine.url()}/raygym/stats").json()
    return client.get(f"{engine.url()}/raygym/stats").json()


def make_sync(engine, vllm_python, trainer, cast_dtype=None, **over) -> WeightSync:
    sync = WeightSync(recipe(vllm_python, **over), [trainer], [engine.url()], engine_kind="vllm", session=True,
                      spec_overrides={"master_address": "127.0.0.1", "cast_dtype": cast_dtype})
    sync.setup()
    return sync


def assert_serves_trainer(engine, trainer, version: int) -> None:
    assert engine.call(Endpoint.MODEL_INFO)["weight_version"] == str(version)
    prompt = [3, 4, 5, 6]
    answer = generate(engine, [prompt], sampling_seed=11)[0]
    assert answer["meta_info"]["weight_version"] == str(version)
    tokens = answer["output_ids"]
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    want = trainer.probe_log_probs([prompt], [tokens])[0]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.01


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_full_sync_is_verified_by_probe(engine, vllm_python, vllm_model, tmp_path, transport):
    trainer = LocalTrainer(vllm_model, lr=2e-2)
    sync = make_sync(engine, vllm_python, trainer, update_weight_transport=transport,
                     update_weight_disk_dir=str(tmp_path / "sync"))
    try:
        for version in (1, 2, 3):
            if version > 1:
                trainer.train_step()
            metrics = sync.push(version)
            assert metrics["sync/mode"] == 0.0 and metrics["sync/full_resyncs"] == 0.0
            assert metrics["sync/verified_versions"] == 1.0 and metrics["sync/probe_tokens"] > 0
            assert metrics["sync/probe_logprob_diff_mean"] <= 0.01
            assert_serves_trainer(engine, trainer, version)
    finally:
        sync.shutdown()


class DroppingTrainer(LocalTrainer):
    """Sends every tensor but one: an update that never reaches one layer."""

    def hf_weights(self):
        for name, t in super().hf_weights():
            if name != "lm_head.weight":
                yield name, t


def test_a_tensor_that_never_arrives_fails_the_probe(engine, vllm_python, vllm_model, tmp_path):
    reset = make_sync(engine, vllm_python, LocalTrainer(vllm_model), update_weight_transport="disk",
                      update_weight_disk_dir=str(tmp_path / "reset"))
    reset.push(1)  # the engine holds the checkpoint again (earlier tests trained it)
    reset.shutdown()
    trainer = DroppingTrainer(vllm_model, lr=2e-1)
    sync = make_sync(engine, vllm_python, trainer, update_weight_transport="nccl")
    try:
        sync.push(1)  # lm_head is still the checkpoint's: the trainer has not moved yet
        for _ in range(3):
            trainer.train_step()
        with pytest.raises(WeightSyncError, match="probe log-probs differ"):
            sync.push(2)
        assert sync.full_resyncs == 1  # one full resync was tried before giving up
    finally:
        sync.shutdown()


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_delta_through_the_workers_snapshot(engine, vllm_python, vllm_model, tmp_path, transport):
    """bf16 payloads at a small learning rate: most elements keep their bf16 bytes, so deltas are small; each
    is rebuilt into full tensors from the workers' snapshot."""
    trainer = LocalTrainer(vllm_model, lr=1e-6)
    sync = make_sync(engine, vllm_python, trainer, cast_dtype="bfloat16", update_weight_transport=transport,
                     update_weight_mode="delta", update_weight_disk_dir=str(tmp_path / "sync"))
    history = []
    try:
        for version in (1, 2, 3):
            if version > 1:
                trainer.train_step()
            history.append(sync.push(version))
            assert engine.call(Endpoint.MODEL_INFO)["weight_version"] == str(version)
            assert history[-1]["sync/probe_logprob_diff_mean"] <= 0.05  # bf16 payload, fp32 trainer
    finally:
        sync.shutdown()
    assert [m["sync/mode"] for m in history] == [0.0, 1.0, 1.0]
    assert all(m["sync/full_resyncs"] == 0.0 for m in history)
    assert history[1]["sync/bytes"] < 0.5 * history[0]["sync/bytes"] and 0 < history[1]["sync/changed_frac"] < 0.5
    if transport == "disk":
        assert list((tmp_path / "sync").iterdir()) == []  # acknowledged versions are removed


def test_a_restarted_engine_serves_again_and_the_delta_it_cannot_apply_is_resynced(engine, vllm_python, vllm_model,
                                                                                tmp_path):
    """A restarted engine listens on a new port and holds no snapshot: its worker reports the delta it cannot
    apply, the coordinator resyncs in full, and the engine serves the trainer's weights."""
    trainer = LocalTrainer(vllm_model, lr=1e-6)  # small steps: bf16 deltas, not full entries, are sent
    sync = make_sync(engine, vllm_python, trainer, cast_dtype="bfloat16", update_weight_transport="disk",
                     update_weight_mode="delta", update_weight_disk_dir=str(tmp_path / "sync"))
    sync.push(1)
    before = engine.url()
    after = engine.restart()  # the new process holds no snapshot
    assert after != before and engine.alive() and engine.restarts == 1
    assert len(generate(engine, [[2, 3]])[0]["output_ids"]) == 6
    sync.links[0].base_url = after
    trainer.train_step()
    metrics = sync.push(2)
    assert metrics["sync/full_resyncs"] == 1.0 and metrics["sync/mode"] == 0.0
    assert_serves_trainer(engine, trainer, 2)
    trainer.train_step()
    assert sync.push(3)["sync/mode"] == 1.0  # the full resync seeded the new snapshot: deltas again
    assert_serves_trainer(engine, trainer, 3)
    sync.shutdown()


def test_a_sync_that_cannot_verify_fails_loudly(engine, vllm_python, vllm_model):
    """bf16 payloads for an fp32 trainer leave a real difference, which a tolerance of 1e-12 cannot accept:
    the push must raise, not report success (an fp32 engine may match the fp32 trainer bit for bit)."""
    trainer = LocalTrainer(vllm_model)
    sync = make_sync(engine, vllm_python, trainer, cast_dtype="bfloat16", update_weight_probe_tolerance=1e-12)
    with pytest.raises(WeightSyncError, match="probe log-probs differ"):
        sync.push(1)
    sync.shutdown()


def test_an_update_mid_generation_splits_the_response_into_two_versions(engine, vllm_python, vllm_model):
    """fully_async on vLLM: the sync aborts the request in flight, raygym continues it on the new weights; each
    part's log-probs match the trainer at its own version."""
    from tests.inflight_split import assert_update_mid_generation_splits_versions

    trainer = LocalTrainer(vllm_model, lr=2e-2)
    sync = make_sync(engine, vllm_python, trainer, fully_async=True)
    try:
        sync.push(1)
        with stats_client() as client:
            assert_update_mid_generation_splits_versions(engine, sync, trainer, 1,
                                                         lambda: stats(engine, client)["running"] > 0, tolerance=0.01,
                                                         max_new_tokens=LONG_CONTEXT - 16)
    finally:
        sync.shutdown()


# ----- verification catches one wrong tensor -----


def engine_dtype(engine) -> torch.dtype:
    return torch.float32 if engine.engine_info()["dtype"] == "float32" else torch.bfloat16


@pytest.mark.parametrize("fault", FAULTS)
def test_one_wrong_tensor_the_engine_loaded_fails_its_checksums(engine, vllm_python, vllm_model, fault, tmp_path):
    """The workers' checksums of what they loaded see a tensor left stale or scaled by 1.01 in the engine (here
    rewritten in the version directory between the sender and the engine)."""
    trainer = FaultyTrainer(vllm_model, lr=1e-5)
    link = TamperingLink(engine.url(), trainer, disk=True)
    sync = WeightSync(recipe(vllm_python, update_weight_transport="disk", update_weight_disk_dir=str(tmp_path)),
                      [trainer], [link], engine_kind="vllm", session=True,
                      spec_overrides={"master_address": "127.0.0.1"})
    sync.setup()
    try:
        assert sync.push(1)["sync/verified_tensors"] == len(list(trainer.hf_weights()))
        trainer.arm(MLP_TENSOR, fault)
        trainer.disarm()
        link.armed = (MLP_TENSOR, fault)
        with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) differ \['" + MLP_TENSOR):
            sync.push(2)
        link.armed = None
        assert sync.push(3)["sync/resynced"] == 0.0
    finally:
        sync.shutdown()


@pytest.mark.parametrize(("fault", "name"), [("stale", MLP_TENSOR), ("scaled", ATTENTION_TENSOR)])
def test_one_wrong_tensor_the_trainer_sent_fails_the_calibrated_probe(engine, vllm_python, vllm_model, fault, name):
    """What was sent arrived (checksums agree), but it is not the trainer's model: the probe, calibrated at
    the first sync, sees it. In bf16 a tensor scaled by 1.01, or one step of 1e-3 behind, is within the noise
    of bf16 kernels against an fp32 trainer (measured: it moves the probe by less than the floor; x1.1 and a step
    of 1e-2 move its mean 1.7x / 1.2x past the tolerance), so there the fault is x1.2 and a step of 3e-2; float32
    engines see 1.01 (tests/vllm_cpu/test_moe_vllm.py too)."""
    fp32 = engine_dtype(engine) == torch.float32
    trainer = FaultyTrainer(vllm_model, lr=1e-3 if fp32 else 3e-2, scale=1.01 if fp32 else 1.2)
    sync = make_sync(engine, vllm_python, trainer)
    try:
        first = sync.push(1)
        print(f"vLLM {engine.engine_info()['dtype']}: floor {first['sync/probe_floor_mean']:.2e} / "
              f"{first['sync/probe_floor_max']:.2e} over {first['sync/probe_tokens']:.0f} tokens")
        trainer.arm(name, fault)
        with pytest.raises(WeightSyncError, match="probe log-probs differ") as failed:
            sync.push(2)
        print(failed.value)
        trainer.disarm()
        assert sync.push(3)["sync/resynced"] == 0.0
    finally:
        sync.shutdown()


def test_syncs_raise_no_false_alarm(engine, vllm_python, vllm_model):
    """As many syncs as fit in ~40 s, the model moving far (lr 1e-2): none fails the calibrated probe."""
    trainer = FaultyTrainer(vllm_model, lr=1e-2)
    sync = make_sync(engine, vllm_python, trainer)
    try:
        history = syncs_for(sync, trainer, 40)
    finally:
        sync.shutdown()
    margin = max(m["sync/probe_margin"] for m in history)
    print(f"{len(history)} vLLM syncs without a false alarm in ~40 s (worst margin {margin:.2f})")
    assert len(history) >= 10 and margin <= 1.0


def test_seeded_prompts_beyond_one_steps_token_budget_all_answer(engine, tmp_path):
    """More prompt tokens at once than vLLM's default step budget (2048): with chunked prefill vLLM splits one
    prefill, discards its sample and rewinds the seeded generator by an offset CPU generators lack, and the worker
    died (raygym.engines.launch.vllm.cpu_engine_args). Every seeded prompt must answer, and the engine live on."""
    prompts = [[3 + (7 * i + j) % 40 for j in range(900)] for i in range(6)]  # 5400 prompt tokens
    answers = generate(engine, prompts, sampling_seed=5)
    assert len(answers) == len(prompts) and all(len(a["output_ids"]) == 6 for a in answers)
    again = generate(engine, prompts[:2], sampling_seed=5)
    assert [a["output_ids"] for a in again] == [a["output_ids"] for a in answers[:2]]
