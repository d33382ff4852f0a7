"""LoRA benchmark: what adapter-only training costs and saves against full fine-tuning, each measured beside its
baseline in the same run. JSON lines, one figure each (value, baseline, ratio and what the ratio is, goal,
machine with its load).

1. ``sync``: the weight-sync benchmark's ~100M-parameter Qwen3 shape (hidden 768, 12 layers, vocab 32000, tied
   embeddings; ``raygym bench weight_sync``) with real torch trainer ranks (``TrainerActor``) and real raygym
   servers (subprocesses, HTTP, gloo group): after each train step ``WeightSync.push`` (pause, push, checksum
   verification, continue) of the whole model (full fine-tuning) and of rank-16 adapters on every linear layer
   (LoRA): bytes and seconds per sync. Also the adapter share of the bytes for other target sets and for the
   Qwen3-4B / 8B shapes (from their architectures on the meta device), and what unmerged adapters cost raygym's
   server per generated token (the same request, adapters attached or not).
2. ``memory``: peak resident memory of one trainer rank (a fresh process each: the model loaded, 4 optimizer
   steps) with LoRA against full fine-tuning, on the same model.
3. ``curve``: the default task (``raygym train``, tiny preset) fully fine-tuned and with LoRA (the tiny preset's
   LoRA settings): the steps until the 5-step mean reward is 0.3 above the first 5 steps'.

    raygym bench lora [--skip sync memory curve] [--syncs 4] [--rank 16] [--curve-steps 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raygym.bench.common import figure_row, wait_healthy


def machine() -> dict:
    import torch

    return {"cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__, "platform": platform.platform(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def emit(figure: str, value: float, unit: str = "s", baseline: float | None = None, ratio: float | None = None,
         ratio_is: str | None = None, goal: str | None = None, **extra) -> None:
    print(json.dumps(figure_row(figure, value, machine(), unit, baseline, ratio, ratio_is, goal, **extra)),
          flush=True)


# --------------------------------------------------------------------------- models


def save_benchmark_model(directory: Path) -> str:
    """The weight-sync benchmark's ~100M-parameter Qwen3 shape (random, fp32) with the builtin tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from raygym.builtin import build_tokenizer

    if (directory / "config.json").is_file():
        return str(directory)
    config = Qwen3Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
                         initializer_range=0.02, max_position_embeddings=512, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return str(directory)


def recipe_for(lora_rank: int, targets: str = "all-linear", **over):
    from raygym.config import Recipe

    fields = dict(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1, rollout_engine="raygym",
                  trainer_backend="torch", lr=1e-5 if lora_rank == 0 else 1e-4, weight_decay=0.0, rollout_batch_size=2,
                  n_samples_per_prompt=4, global_batch_size=8, max_tokens_per_gpu=4096, update_weight_timeout=600.0)
    if lora_rank:
        fields.update(lora_rank=lora_rank, lora_alpha=2 * lora_rank, lora_target_modules=targets)
    return Recipe(**{**fields, **over})


def trainer(model_dir: str, recipe):
    from raygym.config import ModelConfig, TrainConfig
    from raygym.trainer import TrainerActor, TrainerSettings

    actor = TrainerActor(settings=TrainerSettings.from_config(TrainConfig(recipe=recipe,
                                                                          model=ModelConfig(hf_checkpoint=model_dir))))
    actor.init()
    return actor


def random_batch(seed: int, samples: int = 8, prompt: int = 32, response: int = 96):
    import torch

    from raygym.trainer import TrainBatch
    from raygym.types import Sample

    gen = torch.Generator().manual_seed(seed)
    rows = [Sample(prompt="p", prompt_tokens=torch.randint(2, 40, (prompt,), generator=gen).tolist(),
                   group_index=i // 4, sample_index=i % 4,
                   response_tokens=torch.randint(2, 40, (response,), generator=gen).tolist(),
                   loss_mask=[1] * response, reward=float(i % 2)) for i in range(samples)]
    return TrainBatch.from_samples(rows, group_size=4)


def train_once(actor, seed: int) -> None:
    batch = random_batch(seed)
    actor.train_step(batch.with_log_probs(actor.compute_log_probs(batch)).with_advantages("grpo"), seed)


# --------------------------------------------------------------------------- 1. sync


def adapter_share(model_dir_or_config, rank: int, targets: tuple[str, ...]) -> tuple[int, int]:
    """(adapter parameters, model parameters) of rank-``rank`` adapters on ``targets``, from the architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from raygym.lora import LoraSpec, linear_modules, resolve_targets

    config = (AutoConfig.from_pretrained(model_dir_or_config) if isinstance(model_dir_or_config, str)
              else model_dir_or_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    modules = dict(model.named_modules())
    chosen = resolve_targets(LoraSpec(rank, 2 * rank, 0.0, targets), linear_modules(model))
    adapter = sum(rank * (modules[p].in_features + modules[p].out_features) for p in chosen)
    total = sum(p.numel() for p in model.parameters())
    return adapter, total


@contextlib.contextmanager
def raygym_server(model_dir: str, extra_args: list[str]) -> Iterator[str]:
    """One raygym server subprocess on CPU (its output on stderr, so stdout stays JSON lines); yields its URL."""
    from raygym.weightsync.payload import LOADER
    from raygym.weightsync.transport_dist import free_port

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "raygym.engines.raygym_server.server", "--model-path", model_dir, "--host",
                             "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
                             "--custom-weight-loader", LOADER, *extra_args],
                            stdout=sys.stderr, stderr=sys.stderr)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 600)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def generation_seconds(url: str, prompts: int, tokens: int) -> float:
    import httpx

    from raygym.engine_api.auth import auth_headers
    from raygym.engine_api.protocol import Endpoint, GenerateRequest, body_fields

    body = body_fields(GenerateRequest(input_ids=[[5 + (i % 30)] * 16 for i in range(prompts)], return_logprob=True,
                                       sampling_params={"max_new_tokens": tokens, "temperature": 1.0,
                                                        "ignore_eos": True}))
    start = time.perf_counter()
    answer = httpx.post(f"{url}{Endpoint.GENERATE.value}", json=body, headers=auth_headers(), timeout=600)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - start


def sync_section(args, model_dir: str) -> None:
    from transformers import Qwen3Config

    from raygym.engines.launch.lora import engine_lora_args
    from raygym.lora import LoraSpec, adapter_config, model_targets
    from raygym.weightsync.coordinator import WeightSync

    adapter, total = adapter_share(model_dir, args.rank, ("all-linear",))
    emit(f"adapter_params_over_model[all-linear,r{args.rank}]", adapter / total, unit="ratio", adapter_params=adapter,
         model_params=total, shape="100M benchmark shape", goal="<= 0.02 (bytes of a sync)")
    for attention in (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj")):
        a, t = adapter_share(model_dir, args.rank, attention)
        emit(f"adapter_params_over_model[{','.join(attention)},r{args.rank}]", a / t, unit="ratio", adapter_params=a,
             model_params=t, shape="100M benchmark shape")
    shapes: tuple[tuple[str, dict[str, Any]], ...] = (("qwen3-4b", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
                        ("qwen3-8b", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)))
    for name, shape in shapes:
        a, t = adapter_share(Qwen3Config(vocab_size=151936, head_dim=128, **shape), args.rank, ("all-linear",))
        emit(f"adapter_params_over_model[all-linear,r{args.rank}]", a / t, unit="ratio", adapter_params=a,
             model_params=t, shape=name)

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    results: dict[str, list[dict[str, float]]] = {}
    gen: dict[str, float] = {}
    runs: list[tuple[str, LoraSpec | None]] = [("full", None)]
    runs += [(t, LoraSpec(args.rank, 2 * args.rank, 0.0, tuple(t.split(",")))) for t in args.targets]
    for label, spec in runs:
        recipe = recipe_for(spec.rank if spec else 0, label)
        actor = trainer(model_dir, recipe)
        targets = model_targets(model_dir, spec) if spec else []
        extra = engine_lora_args("raygym", spec, targets) if spec else []
        with raygym_server(model_dir, extra) as url:
            overrides = {"adapter_config": adapter_config(spec, model_dir, targets)} if spec else {}
            sync = WeightSync(recipe, [actor], [url], engine_kind="raygym", spec_overrides=overrides)
            sync.setup()
            rows = []
            try:
                for version in range(1, args.syncs + 2):
                    train_once(actor, version)
                    rows.append(sync.push(version))
            finally:
                sync.shutdown()
            results[label] = rows[1:]  # the first sync allocates (one-time setup, sync/setup_s)
            generation_seconds(url, 8, 8)  # warm-up
            gen[label] = min(generation_seconds(url, args.gen_prompts, args.gen_tokens) for _ in range(3))
        del actor

    def mean(label: str, key: str) -> float:
        return sum(r[key] for r in results[label]) / len(results[label])

    for label in args.targets:
        emit(f"sync_bytes[{label},r{args.rank}_vs_full]", mean(label, "sync/bytes"), unit="bytes",
             baseline=mean("full", "sync/bytes"), ratio=mean(label, "sync/bytes") / mean("full", "sync/bytes"),
             ratio_is="adapter bytes / full-model bytes per sync", goal="<= 0.02", syncs=len(results[label]),
             verified_tensors=[mean(label, "sync/verified_tensors"), mean("full", "sync/verified_tensors")])
        emit(f"sync_seconds[{label},r{args.rank}_vs_full]", mean(label, "sync/time_s"),
             baseline=mean("full", "sync/time_s"), ratio=mean(label, "sync/time_s") / mean("full", "sync/time_s"),
             ratio_is="seconds per verified sync (pause to continue), adapters / full model",
             transfer_s=[mean(label, "sync/transfer_s"), mean("full", "sync/transfer_s")], syncs=len(results[label]))
        emit(f"server_generate_seconds[{label},r{args.rank}_vs_none]", gen[label], baseline=gen["full"],
             ratio=gen[label] / gen["full"],
             ratio_is="raygym's server: one batched /generate with the unmerged adapters / without adapters",
             prompts=args.gen_prompts, new_tokens=args.gen_tokens)


# --------------------------------------------------------------------------- 2. memory


def high_water_rss() -> int:
    """This process's peak resident memory in bytes (``VmHWM``: its own address space's, which ``ru_maxrss``
    is not after a fork from a large parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_rss_child(model_dir: str, rank: int, tokens: int, recompute: bool) -> None:
    """In a fresh process: load the trainer, take 4 optimizer steps (micro-batches of at most ``tokens`` tokens,
    activations recomputed or not), print the peak resident memory."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    before = high_water_rss()
    actor = trainer(model_dir, recipe_for(rank, global_batch_size=8, max_tokens_per_gpu=tokens,
                                          torch_activation_checkpointing=recompute))
    for step in range(4):
        train_once(actor, step)
    peak = high_water_rss()
    model, optimizer = actor.backend.model, actor.backend.optimizer
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # held in each step
    moments = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor))
    print(json.dumps({"peak": peak, "before": before, "state": weights + grads + moments,
                      "trainable": sum(p.numel() for p in actor.backend.model.parameters() if p.requires_grad)}))


def memory_section(args, model_dir: str) -> None:
    """Activations (and the logits over the vocabulary) are the same with and without LoRA, so the peak's ratio
    depends on how many a micro-batch holds: measured for micro-batches of 256 and 1024 tokens; the training state
    (weights, gradients, optimizer state) is counted apart."""
    for tokens, recompute in ((256, False), (1024, False)):
        peaks = {}
        for label, rank in (("full", 0), ("lora", args.rank)):
            done = subprocess.run([sys.executable, "-m", "raygym.bench.lora", "--peak-rss-child", model_dir, "--rank", str(rank),
                                   "--tokens", str(tokens)] + (["--recompute"] if recompute else []),
                                  capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, done.stderr[-3000:]
            peaks[label] = json.loads(done.stdout.strip().splitlines()[-1])
        full, lora = peaks["full"], peaks["lora"]
        tag = f"{tokens}tok{',recompute' if recompute else ''}"
        emit(f"trainer_peak_rss[lora_vs_full,{tag}]", lora["peak"] / 2**20, unit="MiB", baseline=full["peak"] / 2**20,
             ratio=lora["peak"] / full["peak"], ratio_is="peak resident memory of one trainer rank, LoRA / full",
             goal="<= 0.5", rank=args.rank, trainable_params=[lora["trainable"], full["trainable"]],
             over_startup_mib=[round((lora["peak"] - lora["before"]) / 2**20, 1),
                               round((full["peak"] - full["before"]) / 2**20, 1)],
             micro_batch_tokens=tokens, activation_recompute=recompute)
    emit("trainer_state_bytes[lora_vs_full]", lora["state"] / 2**20, unit="MiB", baseline=full["state"] / 2**20,
         ratio=lora["state"] / full["state"], ratio_is="weights + gradients + optimizer state a trainer rank holds "
         "during a step (counted on the live tensors), LoRA / full", goal="<= 0.5")


# --------------------------------------------------------------------------- 3. curve


def steps_to_gain(rewards: list[float], gain: float) -> int | None:
    """The first step whose 5-step mean reward (that step and the 4 before) is ``gain`` above the first 5's.

    >>> steps_to_gain([0.0] * 5 + [1.0] * 5, 0.3)  # steps 2-6 average 0.4
    6
    """
    base = sum(rewards[:5]) / 5
    return next((i for i in range(4, len(rewards)) if sum(rewards[i - 4 : i + 1]) / 5 >= base + gain), None)


def curve_section(args) -> None:
    runs = {}
    with tempfile.TemporaryDirectory(prefix="raygym-lora-curve-") as tmp:
        for label, flags, steps in (("full", [], args.curve_steps), ("lora", ["--lora-rank", "8"], 2 * args.curve_steps)):
            out = Path(tmp) / label
            env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rgl-", dir="/tmp")}
            start = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "raygym", "train", *flags, "--num-rollout", str(steps),
                                   "--save-interval", "100000", "--output-dir", str(out)], env=env,
                                  capture_output=True, text=True, timeout=7200)
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            runs[label] = ([r["rollout/reward_mean"] for r in rows], time.perf_counter() - start)
    (full, full_s), (lora, lora_s) = runs["full"], runs["lora"]
    full_hit, lora_hit = steps_to_gain(full, 0.3), steps_to_gain(lora, 0.3)
    emit("steps_to_reward_plus_0.3[lora_vs_full]", float(lora_hit if lora_hit is not None else -1), unit="steps",
         baseline=float(full_hit if full_hit is not None else -1),
         ratio=(lora_hit / full_hit) if lora_hit is not None and full_hit else None,
         ratio_is="steps until the 5-step mean reward is first-5 + 0.3, LoRA / full", goal="<= 2",
         full_first5_last5=[round(sum(full[:5]) / 5, 3), round(sum(full[-5:]) / 5, 3)],
         lora_first5_last5=[round(sum(lora[:5]) / 5, 3), round(sum(lora[-5:]) / 5, 3)],
         lora_at_full_steps=round(sum(lora[len(full) - 5 : len(full)]) / 5, 3), seconds=[lora_s, full_s],
         command="raygym train [--lora-rank 8] --num-rollout N (tiny preset; LoRA: its lm_head-inclusive targets, lr 3e-3)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", nargs="*", default=[], choices=["sync", "memory", "curve"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--syncs", type=int, default=4, help="measured syncs per mode (after a first, one-time one)")
    ap.add_argument("--targets", nargs="*", default=["all-linear", "q_proj,k_proj,v_proj,o_proj"],
                    help="LoRA target sets whose syncs are measured against full fine-tuning")
    ap.add_argument("--gen-prompts", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--curve-steps", type=int, default=60, help="full fine-tuning steps (LoRA gets twice as many)")
    ap.add_argument("--model-dir", default="", help="where the 100M benchmark model is kept (default: a temp dir)")
    ap.add_argument("--peak-rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_rss_child:
        peak_rss_child(args.peak_rss_child, args.rank, args.tokens, args.recompute)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="raygym-lora-bench-") as tmp:
        model_dir = save_benchmark_model(Path(args.model_dir or tmp) / "qwen3-100m")
        if "sync" not in args.skip:
            sync_section(args, model_dir)
        if "memory" not in args.skip:
            memory_section(args, model_dir)
    if "curve" not in args.skip:
        curve_section(args)


if __name__ == "__main__":
    main()
