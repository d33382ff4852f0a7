"""Trainer throughput: tokens/s of ``TorchBackend.train_step``.

CPU (always): the builtin tiny Qwen3 on a batch of mixed-length samples, dynamic batching
(``max_tokens_per_gpu``) against fixed micro-batches in the same run (ratio = dynamic / fixed).
GPU (only when CUDA is present): a Qwen3-0.6B-architecture model with random weights, tokens/s and MFU
(6 * params * tokens/s over the GPU's dense bf16 peak; attention FLOPs not counted).

    raygym bench train_step [--repeats 3] [--samples 64]

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time

import torch

from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.trainer import TrainBatch, TrainerSettings
from raygym.trainer.torch_backend import TorchBackend
from raygym.types import Sample

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def machine() -> dict:
    info = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        info["device"] = "cpu"
    return info


def mixed_batch(n: int, vocab: int, min_len: int, max_len: int, group_size: int, seed: int = 0) -> TrainBatch:
    """Prompts of 16..64 tokens, responses long-tailed between min_len and max_len (as RL rollouts are)."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(16, 64))]
        length = min(max_len, int(min_len + rng.expovariate(1.0) * (max_len - min_len) / 3))
        response = [rng.randrange(2, vocab) for _ in range(length)]
        samples.append(
            Sample(
                prompt="",
                prompt_tokens=prompt,
                group_index=i // group_size,
                response_tokens=response,
                reward=rng.random(),
            )
        )
    return TrainBatch.from_samples(samples, group_size=group_size)


def measure(settings: TrainerSettings, batch: TrainBatch, repeats: int) -> dict:
    backend = TorchBackend(settings)
    backend.init()
    batch = batch.with_log_probs(backend.compute_log_probs(batch)).with_advantages("grpo")
    backend.train_step(batch, 0)  # warm-up
    times = []
    for i in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.train_step(batch, i + 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = sum(batch.total_lengths())
    seconds = statistics.median(times)
    params = sum(p.numel() for p in backend.model.parameters())
    del backend
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "params": params}


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def one_rank_settings(path: str, **recipe_fields) -> TrainerSettings:
    """The trainer's view of a one-rank recipe of ``recipe_fields`` on the model at ``path``."""
    recipe = Recipe(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1, **recipe_fields)
    return TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=path)))


def cpu_figures(repeats: int, samples: int) -> None:
    from raygym.builtin import TINY_MODEL, materialize_model

    path = materialize_model(TINY_MODEL, os.path.join(tempfile.gettempdir(), "raygym-bench-models"))
    batch = mixed_batch(samples, vocab=40, min_len=8, max_len=190, group_size=8)
    common = dict(
        lr=1e-5,
        global_batch_size=samples,
        rollout_batch_size=samples // 8,
        n_samples_per_prompt=8,
    )
    dynamic = measure(
        one_rank_settings(path, use_dynamic_batch_size=True, max_tokens_per_gpu=2048, **common), batch, repeats
    )
    for mbs in (1, 8):
        fixed = measure(
            one_rank_settings(path, use_dynamic_batch_size=False, micro_batch_size=mbs, **common), batch, repeats
        )
        emit(
            {
                "figure": "train_tokens_per_s_dynamic_batching",
                "model": "builtin:tiny-qwen3",
                "value": round(dynamic["tokens_per_s"], 1),
                "baseline": f"fixed micro_batch_size={mbs}",
                "baseline_value": round(fixed["tokens_per_s"], 1),
                "ratio": round(dynamic["tokens_per_s"] / fixed["tokens_per_s"], 3),
                "tokens_per_step": dynamic["tokens"],
                "max_tokens_per_gpu": 2048,
                "machine": machine(),
            }
        )


def qwen3_0_6b_random(directory: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from raygym.builtin import build_tokenizer

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,  # type: ignore[call-arg]  # transformers 5 takes it through **kwargs
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def gpu_figures(repeats: int) -> None:
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    with tempfile.TemporaryDirectory() as d:
        path = qwen3_0_6b_random(d)
        batch = mixed_batch(64, vocab=150000, min_len=128, max_len=2048, group_size=8)
        common = dict(lr=1e-6, global_batch_size=64, rollout_batch_size=8, n_samples_per_prompt=8)
        dyn = measure(one_rank_settings(path, use_dynamic_batch_size=True, max_tokens_per_gpu=16384, **common),
                      batch, repeats)
        fixed = measure(one_rank_settings(path, use_dynamic_batch_size=False, micro_batch_size=4, **common),
                        batch, repeats)
    mfu = 6 * dyn["params"] * dyn["tokens_per_s"] / (peak * 1e12) if peak else None
    emit(
        {
            "figure": "train_tokens_per_s_gpu",
            "model": "qwen3-0.6b-architecture (random weights)",
            "value": round(dyn["tokens_per_s"], 1),
            "baseline": "fixed micro_batch_size=4",
            "baseline_value": round(fixed["tokens_per_s"], 1),
            "ratio": round(dyn["tokens_per_s"] / fixed["tokens_per_s"], 3),
            "mfu": round(mfu, 4) if mfu is not None else None,
            "params": dyn["params"],
            "tokens_per_step": dyn["tokens"],
            "machine": machine(),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    if not args.skip_cpu:
        cpu_figures(args.repeats, args.samples)
    if torch.cuda.is_available():
        gpu_figures(args.repeats)


if __name__ == "__main__":
    main()
