"""GPU check of the Megatron backend on one GPU (TP=1), Qwen3-0.6B architecture with random weights.

Steps (each reported as it finishes; a failing step prints its error and the next ones still run):
  1. write a random-weight Qwen3-0.6B-architecture HF checkpoint (bf16) to a temp dir;
  2. MegatronBackend.init (qkv_format "bshd": Megatron's own attention; "thd" too when
     transformer-engine imports), log-probs, a few train steps -> trainer tokens/s and MFU;
  3. HF export through weight_mapping (iter_hf_weights -> save_hf);
  4. TorchBackend on the exported weights: its log-probs must match Megatron's within bf16 tolerance.

MFU = (6 * params + 6 * layers * q_width * mean context) * tokens/s / peak dense bf16 FLOP/s
(the second term is causal attention; recomputation is not counted as useful work).

    scripts/gpu_check.sh            # or: raygym bench gpu_check [--steps 3]

Prints one JSON object per line (figure, value, baseline, ratio, machine). Budget: < 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
T0 = time.time()


def emit(figure: str, value, baseline=None, **extra) -> None:
    ratio = (value / baseline) if isinstance(value, (int, float)) and baseline else None
    print(json.dumps({"figure": figure, "value": value, "baseline": baseline, "ratio": ratio,
                      "elapsed_s": round(time.time() - T0, 1), "machine": machine(), **extra}), flush=True)


def machine() -> dict:
    info = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def make_checkpoint(directory: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from raygym.builtin import build_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3_0_6B, dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).bfloat16()
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)  # any tokenizer: only token ids are used here
    del model
    torch.cuda.empty_cache()
    return directory


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from raygym.algo import group_advantages
    from raygym.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lens = [(prompt_len, response_len - (i % 4) * 16) for i in range(n)]
    tokens = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in lens]
    rewards = [float(i % 3 == 0) for i in range(n)]
    batch = TrainBatch(tokens=tokens, prompt_lengths=[p for p, _ in lens], response_lengths=[r for _, r in lens],
                       loss_masks=[torch.ones(r) for _, r in lens], rewards=rewards, group_size=4)
    adv = group_advantages(torch.tensor(rewards), 4)
    batch.advantages = [torch.full((r,), float(a)) for (_, r), a in zip(lens, adv, strict=True)]
    return batch


def settings_for(path: str, args, **recipe_fields):
    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.trainer.backend import TrainerSettings

    # samples in groups of 4, two optimizer steps per train step, one rank
    recipe = Recipe(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1, lr=1e-6,
                    rollout_batch_size=args.samples // 4, n_samples_per_prompt=4, global_batch_size=args.samples // 2,
                    max_tokens_per_gpu=args.max_tokens, rollout_temperature=1.0, seed=1234, **recipe_fields)
    return TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=path)))


def run_megatron(path: str, qkv_format: str, args, batch) -> tuple[object, list[torch.Tensor]]:
    from raygym.trainer.megatron_backend import MegatronBackend

    settings = settings_for(path, args, trainer_backend="megatron", qkv_format=qkv_format, recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1)
    backend = MegatronBackend(settings)
    t = time.time()
    facts = backend.init()
    emit(f"megatron_{qkv_format}_init_s", round(time.time() - t, 2), facts=facts)

    tokens = sum(int(x.numel()) for x in batch.tokens)
    torch.cuda.synchronize()
    t = time.time()
    log_probs = backend.compute_log_probs(batch)["log_probs"]
    torch.cuda.synchronize()
    emit(f"megatron_{qkv_format}_logprob_tokens_per_s", round(tokens / (time.time() - t), 1))
    batch.old_log_probs = log_probs

    backend.train_step(batch, rollout_id=0)  # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    t = time.time()
    metrics = {}
    for step in range(args.steps):
        metrics = backend.train_step(batch, rollout_id=step + 1)
    torch.cuda.synchronize()
    seconds = time.time() - t
    tok_s = tokens * args.steps / seconds
    n_params = sum(p.numel() for p in backend.model.parameters())
    mean_ctx = sum(int(x.numel()) for x in batch.tokens) / len(batch.tokens) / 2
    q_width = QWEN3_0_6B["num_attention_heads"] * QWEN3_0_6B["head_dim"]
    flops_per_token = 6 * n_params + 6 * QWEN3_0_6B["num_hidden_layers"] * q_width * mean_ctx
    peak = peak_flops()
    emit(f"megatron_{qkv_format}_train_tokens_per_s", round(tok_s, 1), params=n_params,
         peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
         last_metrics={k: round(v, 6) for k, v in metrics.items()})
    emit(f"megatron_{qkv_format}_mfu", round(flops_per_token * tok_s / peak, 4) if peak else None,
         note="model FLOPs (6N + causal attention) over dense bf16 peak")
    return backend, log_probs


def compare_with_torch(export_dir: str, megatron_lp: list[torch.Tensor], args, batch, megatron_tok_s=None) -> None:
    from raygym.trainer.torch_backend import TorchBackend

    backend = TorchBackend(settings_for(export_dir, args))
    backend.init()
    tokens = sum(int(x.numel()) for x in batch.tokens)
    torch.cuda.synchronize()
    t = time.time()
    torch_lp = backend.compute_log_probs(batch)["log_probs"]
    torch.cuda.synchronize()
    emit("torch_logprob_tokens_per_s", round(tokens / (time.time() - t), 1))
    diffs = torch.cat([(a.float() - b.float()).abs() for a, b in zip(megatron_lp, torch_lp, strict=True)])
    mean_diff, max_diff = float(diffs.mean()), float(diffs.max())
    # bf16 compute on both sides: ~3 significant digits per op, log-probs of ~-12 -> allow 0.05 mean.
    ok = mean_diff < 0.05 and max_diff < 1.0
    emit("megatron_vs_torch_logprob_mean_abs_diff", round(mean_diff, 6), max_abs_diff=round(max_diff, 6),
         within_bf16_tolerance=ok)
    if not ok:
        raise AssertionError(f"log-probs differ beyond bf16 tolerance: mean {mean_diff}, max {max_diff}")


def step(name: str, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except Exception as exc:  # report and continue with the next step
        emit(f"{name}_error", None, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        emit("gpu_check_skipped", None, reason="no CUDA device")
        return 0
    try:
        from raygym.trainer.megatron_backend import has_transformer_engine, require_megatron

        require_megatron()
    except ImportError as exc:
        emit("gpu_check_skipped", None, reason=str(exc))
        return 0
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="raygym-gpucheck-") as tmp:
        ckpt = step("checkpoint", make_checkpoint, os.path.join(tmp, "qwen3-0.6b-random"))
        if ckpt is None:
            return 1
        batch = make_batch(args.samples, args.prompt_len, args.response_len, QWEN3_0_6B["vocab_size"])
        formats = ["bshd"] + (["thd"] if has_transformer_engine() else [])
        for i, fmt in enumerate(formats):
            out = step(f"megatron_{fmt}", run_megatron, ckpt, fmt, args, batch)
            if out is None:
                failures += 1
                continue
            backend, _ = out
            if i == 0:
                export_dir = os.path.join(tmp, "export")
                t = time.time()
                exported = step("hf_export", backend.save_hf, export_dir)
                emit("hf_export_s", round(time.time() - t, 2), ok=exported is not None)
                if exported is not None:
                    # Log-probs of the trained weights, then the torch backend on the exported copy.
                    lp = backend.compute_log_probs(batch)["log_probs"]
                    del backend
                    torch.cuda.empty_cache()
                    if step("torch_parity", compare_with_torch, exported, lp, args, batch) is None:
                        failures += 1
                else:
                    failures += 1
            else:
                del backend
                torch.cuda.empty_cache()
    emit("gpu_check_done", failures == 0, failures=failures)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
