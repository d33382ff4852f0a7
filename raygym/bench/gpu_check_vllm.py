"""GPU check of vLLM as raygym's engine: raygym's adapter (``python -m raygym.engines.vllm.server``) around
vLLM's engine on one GPU with a small random Qwen3 (bf16), launched as a run would launch it (colocated:
sleep mode on). Steps, each printed as one JSON line as it finishes (a failing step prints its error and the
next ones still run):

  1. start-up time and what the engine reports (vLLM release, dtype);
  2. generated tokens/s, 64 prompts x 64 new tokens greedy, each prompt its own request, against HF
     ``generate`` of the same model on the same GPU in this process (one batch);
  3. trainer-engine log-prob mismatch on the same weights: the engine's log-probs of its sampled tokens
     (temperature 1) against the fp32 trainer's;
  4. three verified syncs (weight version read back, probe of log-probs against the trainer) per transport,
     through vLLM's weight-transfer lifecycle with raygym's backend: the group (NCCL with a second GPU, the
     trainer on it; gloo on one GPU, as NCCL cannot put two ranks of one group on the same device), disk,
     CUDA IPC (colocated), and deltas over the group and the disk;
  5. colocation: release (vLLM's sleep level 1), the engine's GPU memory before and after (nvidia-smi, its
     process tree), resume weights, a verified sync, resume the KV cache, generate.

    raygym bench gpu_check_vllm [--python PY]        (scripts/gpu_check.sh runs it)

Needs vLLM's CUDA build importable by ``--python`` (default: ``RAYGYM_VLLM_PYTHON``, else this interpreter);
otherwise it says so and exits 0. Budget: under 4 minutes on one H200 (vLLM start ~60 s, eager mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from raygym.bench.gpu_check_sglang import Trainer, make_model

T0 = time.time()
PROMPTS, NEW_TOKENS = 64, 64


def emit(figure: str, **fields) -> None:
    print(json.dumps({"figure": figure, "elapsed_s": round(time.time() - T0, 1), **fields}), flush=True)


def step(name: str):
    """Decorator that runs one check at once; a failure prints its error and the next checks still run."""
    def wrap(fn):
        attempt(name, fn)
    return wrap


def attempt(name: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:
        emit(f"vllm_{name}_failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])


def sync_run(engine, trainer, base: dict, transport: str, mode: str, colocate: bool, first_version: int) -> None:
    """Three verified syncs over ``transport``. The group uses NCCL with the trainer on a second GPU, gloo on
    one GPU (NCCL refuses two ranks of one group on the same device)."""
    from raygym.config import Recipe
    from raygym.weightsync.coordinator import WeightSync

    group_backend = None if transport != "nccl" else ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    trainer_gpu = 1 if group_backend == "nccl" else 0
    torch.cuda.set_device(trainer_gpu)
    trainer.model.to(f"cuda:{trainer_gpu}")
    recipe = Recipe(colocate=colocate, update_weight_transport=transport, update_weight_mode=mode, **base)
    overrides = {"cast_dtype": "bfloat16", "master_address": "127.0.0.1", "backend": group_backend}
    sync = WeightSync(recipe, [trainer], [engine.url()], engine_kind="vllm", session=True, spec_overrides=overrides)
    try:
        sync.setup()
        for version in range(first_version, first_version + 3):
            trainer.step()
            metrics = sync.push(version)
            emit("vllm_sync", transport=transport, mode=mode, group_backend=group_backend, version=version,
                 metrics={k: v for k, v in metrics.items() if k.startswith("sync/")})
    finally:
        sync.shutdown()
        torch.cuda.set_device(0)
        trainer.model.to("cuda:0")


def engine_gpu_mib(root_pid: int) -> float | None:
    """GPU memory (MiB) of ``root_pid`` and its descendants, as nvidia-smi reports per process."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, []))
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used = [float(mib) for pid, mib in (line.split(",") for line in out.strip().splitlines() if "," in line)
            if int(pid) in tree]
    return sum(used) if used else 0.0


def hf_tokens_per_s(model, prompts: list[list[int]]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return PROMPTS * NEW_TOKENS / statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--python", default=os.environ.get("RAYGYM_VLLM_PYTHON") or sys.executable)
    a = p.parse_args()
    probe = subprocess.run([a.python, "-c", "from vllm.platforms import current_platform as p; "
                            "raise SystemExit(0 if p.is_cuda() else 3)"], capture_output=True, text=True)
    if probe.returncode != 0:
        why = "its vLLM is not a CUDA build" if probe.returncode == 3 else "it cannot import vllm"
        emit("vllm_gpu_check", skipped=f"{a.python}: {why}; install vLLM there (pip install vllm) or set "
                                       "RAYGYM_VLLM_PYTHON")
        return
    if not torch.cuda.is_available():
        emit("vllm_gpu_check", skipped="no CUDA device")
        return
    from raygym.config import Recipe
    from raygym.engine_api.auth import new_engine_api_key, use_engine_api_key
    from raygym.engine_api.protocol import Endpoint, GenerateRequest
    from raygym.engines.actor import EngineActor
    from raygym.weightsync.coordinator import WeightSync

    use_engine_api_key(new_engine_api_key())
    model_dir = tempfile.mkdtemp(prefix="qwen3-small-")
    make_model(model_dir)
    disk = tempfile.mkdtemp(prefix="sync-")
    base = dict(rollout_engine="vllm", rollout_engine_python=a.python, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8, eval_interval=None,
                rollout_max_prompt_len=128, rollout_max_response_len=NEW_TOKENS, sglang_mem_fraction_static=0.25,
                sglang_max_running_requests=PROMPTS, update_weight_disk_dir=disk, update_weight_timeout=60.0)
    engine = EngineActor(Recipe(colocate=True, **base), engine_index=0, model_path=model_dir, gpu_ids=[0],
                         host="127.0.0.1", backend="vllm", startup_timeout=180, extra_server_args=["--enforce-eager"])
    trainer: Trainer | None = None
    try:
        start = time.time()
        engine.start()
        emit("vllm_started", seconds=round(time.time() - start, 1), info=engine.engine_info())
        trainer = Trainer(model_dir)
        prompts = [[(7 * i + j) % 500 + 2 for j in range(8 + i % 24)] for i in range(PROMPTS)]

        @step("throughput")
        def _throughput() -> None:
            def one(prompt: list[int]) -> int:
                out = engine.generate(GenerateRequest(input_ids=prompt, sampling_params={
                    "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}))
                assert not isinstance(out, list), "one prompt, one answer"
                return out["meta_info"]["completion_tokens"]

            with ThreadPoolExecutor(PROMPTS) as pool:
                list(pool.map(one, prompts))  # warm-up
                begin = time.perf_counter()
                produced = sum(pool.map(one, prompts))
                seconds = time.perf_counter() - begin
            hf = hf_tokens_per_s(trainer.model.to(torch.bfloat16), prompts)
            trainer.model.float()
            emit("vllm_gpu_tokens_per_s", value=round(produced / seconds, 1), baseline=round(hf, 1),
                 baseline_name="hf_generate_one_batch_bf16_same_gpu", ratio=round(produced / seconds / hf, 3),
                 prompts=PROMPTS, new_tokens=NEW_TOKENS)

        @step("mismatch")
        def _mismatch() -> None:
            answers = engine.generate(GenerateRequest(input_ids=prompts[:16], return_logprob=True, sampling_params=[
                {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": i} for i in range(16)]))
            assert isinstance(answers, list), "a batch: one answer per prompt"
            responses = [[t for _, t, _ in ans["meta_info"]["output_token_logprobs"]] for ans in answers]
            mine = trainer.probe_log_probs(prompts[:16], responses)
            diffs = [abs(lp - want) for ans, row in zip(answers, mine, strict=True)
                     for (lp, _, _), want in zip(ans["meta_info"]["output_token_logprobs"], row, strict=True)]
            emit("vllm_gpu_logprob_mismatch", value=statistics.fmean(diffs), max_abs_diff=max(diffs), tokens=len(diffs),
                 trainer="hf_fp32")

        runs = [("nccl", "full", False), ("disk", "full", False), ("ipc", "full", True), ("nccl", "delta", False),
                ("disk", "delta", False)]
        for number, (transport, mode, colocate) in enumerate(runs):
            attempt(f"sync_{transport}_{mode}", sync_run, engine, trainer, base, transport, mode, colocate,
                    100 * (number + 1))

        @step("sleep_wake")
        def _sleep_wake() -> None:
            pid = engine.pid()
            assert pid is not None, "the engine's server process has no pid"
            before = engine_gpu_mib(pid)
            engine.call(Endpoint.RELEASE_MEMORY)
            released = engine_gpu_mib(pid)
            engine.call(Endpoint.RESUME_MEMORY, tags=["weights"])
            recipe = Recipe(colocate=True, update_weight_transport="ipc", **base)
            sync = WeightSync(recipe, [trainer], [engine.url()], engine_kind="vllm", session=True,
                              spec_overrides={"cast_dtype": "bfloat16", "master_address": "127.0.0.1"})
            sync.setup()
            trainer.step()
            metrics = sync.push(999)
            sync.shutdown()
            engine.call(Endpoint.RESUME_MEMORY, tags=["kv_cache"])
            out = engine.generate(GenerateRequest(input_ids=prompts[0], sampling_params={"max_new_tokens": 8, "ignore_eos": True}))
            assert not isinstance(out, list), "one prompt, one answer"
            emit("vllm_sleep_wake", engine_gpu_mib_before=before, engine_gpu_mib_released=released,
                 engine_gpu_mib_after=engine_gpu_mib(pid), probe_logprob_diff_mean=metrics["sync/probe_logprob_diff_mean"],
                 generated=out["meta_info"]["completion_tokens"])
    finally:
        engine.close()


if __name__ == "__main__":
    main()
