"""The by-engine figures of ``raygym bench rollout`` (see its docstring): tokens/s per engine kind, the
trainer-engine log-prob mismatch on the same weights, and the rollout phase inside ``raygym train`` steps."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from raygym.bench.rollout_timing import ARCHS, baseline_seconds, make_prompts, server_seconds
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL, materialize_model
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.presets import tiny

TRAIN_ARCH = {"head_dim": 32}  # the tiny preset's model with a head size vLLM's CPU attention runs


def emit(figure: str, machine: dict[str, Any], **values: Any) -> None:
    print(json.dumps({"figure": figure, **values, "machine": machine}), flush=True)


def start_engine(kind: str, model_path: str, args: argparse.Namespace, max_running: int) -> EngineActor:
    recipe = tiny().replace(seed=0, sglang_max_running_requests=max_running, rollout_engine=kind,
                            rollout_engine_python=args.vllm_python if kind == "vllm" else "",
                            rollout_max_prompt_len=64, rollout_max_response_len=args.engine_new_tokens)
    extra = ["--num-threads", str(args.threads)] if kind == "raygym" else ["--dtype", args.vllm_dtype]
    actor = EngineActor(recipe, 0, model_path, [], "127.0.0.1", kind, device=args.device, startup_timeout=900,
                        extra_server_args=extra)
    actor.start()
    return actor


def sampled_logprobs(actor: EngineActor, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's seeded sample at temperature 1 and the engine's log-probs of its tokens."""
    answers = actor.generate(GenerateRequest(input_ids=prompts, return_logprob=True,
                                             sampling_params=[{"temperature": 1.0, "max_new_tokens": new_tokens,
                                                               "ignore_eos": True, "sampling_seed": 1000 + i}
                                                              for i in range(len(prompts))]))
    assert isinstance(answers, list), "a batch: one answer per prompt"
    return [([int(t) for _, t, _ in a["meta_info"]["output_token_logprobs"]],
             [float(lp) for lp, _, _ in a["meta_info"]["output_token_logprobs"]]) for a in answers]


def mismatch(model: Any, prompts: list[list[int]], samples: list[tuple[list[int], list[float]]]) -> dict[str, float]:
    diffs = []
    with torch.inference_mode():
        for prompt, (tokens, engine_lp) in zip(prompts, samples, strict=True):
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            diffs.extend((want - torch.tensor(engine_lp)).abs().tolist())
    return {"mean_abs_diff": statistics.fmean(diffs), "max_abs_diff": max(diffs), "tokens": len(diffs)}


def throughput_and_mismatch(args: argparse.Namespace, engines: list[str], machine: dict[str, Any], work: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = materialize_model(TINY_MODEL, work / "engines-10m", seed=0, **ARCHS["10m"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(args.engine_prompts)
    tokens = args.engine_prompts * args.engine_new_tokens
    baseline_seconds(model, prompts, args.engine_new_tokens)  # warm-up
    mismatches: dict[str, dict[str, float]] = {}
    for kind in engines:
        actor = start_engine(kind, path, args, args.engine_prompts)
        info = actor.engine_info()
        pool = ThreadPoolExecutor(args.engine_prompts)
        try:
            server_seconds(actor, pool, prompts, args.engine_new_tokens)  # warm-up
            base, served = [], []
            for _ in range(args.repeats):  # interleaved so machine load hits both alike
                base.append(baseline_seconds(model, prompts, args.engine_new_tokens))
                served.append(server_seconds(actor, pool, prompts, args.engine_new_tokens))
            mismatches[kind] = mismatch(model, prompts, sampled_logprobs(actor, prompts, 16))
        finally:
            pool.shutdown()
            actor.close()
        tps, tps_base = tokens / statistics.median(served), tokens / statistics.median(base)
        emit("rollout_tokens_per_s_by_engine", machine, engine=kind, engine_version=info["version"],
             engine_dtype=info.get("dtype") or "float32", model="10m", params=sum(p.numel() for p in model.parameters()),
             prompts=args.engine_prompts, new_tokens=args.engine_new_tokens, value=round(tps, 1),
             baseline=round(tps_base, 1), baseline_name="hf_generate_one_batch_in_process_fp32",
             ratio=round(tps / tps_base, 3), seconds_engine=[round(x, 3) for x in served],
             seconds_baseline=[round(x, 3) for x in base])
    reference = mismatches.get("raygym")
    for kind, m in mismatches.items():
        ratio = m["mean_abs_diff"] / reference["mean_abs_diff"] if reference and reference["mean_abs_diff"] else None
        emit("logprob_mismatch_by_engine", machine, engine=kind, model="10m", trainer="hf_fp32",
             value=m["mean_abs_diff"], max_abs_diff=m["max_abs_diff"], tokens=m["tokens"],
             baseline=reference["mean_abs_diff"] if reference else None, baseline_name="raygym_server", ratio=ratio)


def hf_step_seconds(model_path: str, repeats: int) -> float:
    """HF ``generate`` sampling one tiny-preset step in process: its prompts x samples, response length,
    temperature and eos."""
    from transformers import AutoModelForCausalLM

    from raygym.builtin import build_tokenizer, next_digit_rows

    recipe = tiny()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = build_tokenizer()
    prompts = [tok.encode(r["prompt"]) for r in next_digit_rows(recipe.rollout_batch_size, 0)
               for _ in range(recipe.n_samples_per_prompt)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    times = []
    for i in range(repeats + 1):
        torch.manual_seed(i)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=recipe.rollout_max_response_len, do_sample=True,
                           temperature=recipe.rollout_temperature, top_p=1.0, top_k=0, eos_token_id=1, pad_token_id=0)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def train_steps(args: argparse.Namespace, engines: list[str], machine: dict[str, Any], work: Path) -> None:
    from raygym import DatasetConfig, ModelConfig, TrainConfig
    from raygym.run.driver import train

    path = materialize_model(TINY_MODEL, work / "train-tiny32", seed=0, **TRAIN_ARCH)
    base = hf_step_seconds(path, args.repeats)
    warmup = min(2, args.train_steps - 1)
    for kind in engines:
        recipe = tiny().replace(num_rollout=args.train_steps, save_interval=10**6, eval_interval=None,
                                rollout_engine=kind, rollout_engine_python=args.vllm_python if kind == "vllm" else "")
        cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=path),
                          dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK), output_dir=str(work / f"train-{kind}"))
        with contextlib.redirect_stdout(sys.stderr):  # progress to stderr: stdout carries only JSON lines
            rows = train(cfg).steps[warmup:]
        rollout_s = statistics.median(float(r["perf/rollout_time"]) for r in rows)
        emit("rollout_phase_s_in_train_step", machine, engine=kind, model="tiny_head_dim32", steps=len(rows),
             value=round(rollout_s, 4), baseline=round(base, 4), baseline_name="hf_generate_sampling_the_step_fp32",
             ratio=round(rollout_s / base, 3),
             generate_s=round(statistics.median(float(r["rollout/generate_time"]) for r in rows), 4),
             step_s=round(statistics.median(float(r["perf/step_time"]) for r in rows), 4),
             logprob_mismatch_mean=statistics.median(float(r["rollout/logprob_mismatch_mean"]) for r in rows),
             logprob_mismatch_max=max(float(r["rollout/logprob_mismatch_max"]) for r in rows),
             reward_first=float(rows[0]["rollout/reward_mean"]), reward_last=float(rows[-1]["rollout/reward_mean"]))


def engine_figures(args: argparse.Namespace, engines: list[str], machine: dict[str, Any], work: Path) -> None:
    """Every by-engine figure for the engine kinds in ``engines``."""
    throughput_and_mismatch(args, engines, machine, work)
    if args.train_steps > 0:
        train_steps(args, engines, machine, work)
