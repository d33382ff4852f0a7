"""End-to-end step time: per-phase split, sync vs async, and TRL's GRPOTrainer, per model size.

Model sizes (``--models``, random Qwen3s with the builtin character tokenizer, 16 prompts x 8 samples):

- ``ref`` (the headline scale): ~2.6M parameters (hidden 256, 4 layers,
  intermediate 512), 16 new tokens;
- ``compute``: ~10.6M parameters (hidden 384, 6 layers, intermediate 1024), 64 new tokens: the model's
  compute, not fixed costs, is most of a step. A random model ends a response with probability ~1/50 per
  token, so response lengths spread from a few tokens to the cap (a long tail even before training):
  what continuous batching (no decoding for finished rows) and length-grouped micro-batches are for, against
  HF ``generate`` and a batch padded to its longest completion;
- ``tiny``: the ``tiny`` preset's ~80K-parameter model, 8 new tokens.

Tasks (``--tasks``): ``next-digit`` (``builtin:next-digit``, the default) and ``long-tail``
(``builtin:long-tail``: most answers 1-3 tokens, one prompt in eight asks for 32-56); every size runs every task.

Figures (one JSON line each, with the machine):

- ``raygym_step_split_<mode>``: mean seconds per step and per phase (rollout wait, log-probs, train,
  sync, eval, other = control overhead) over the measured steps, and other's share of the step;
- ``trl_step_split``: TRL's step split the same way, beside raygym's sync split (``generate_s`` against
  ``rollout_s``, ``train_s`` against ``train_s``; see ``raygym/bench/trl_baseline.py``), and samples/s of both;
- ``async_vs_sync_step_s``, ``fully_async_vs_sync_step_s``: one-step-off (``--async-mode``) and fully
  asynchronous (``--fully-async``, max_staleness 2) step time against the sync step time of the same run, both with
  TIS (their default: ``raygym.config.schedule.off_policy_defaults``), and ``samples_per_s_ratio`` (sync's step /
  theirs). ``--placement`` (default ``disjoint``, the recipe's ``cpu_placement``): the asynchronous runs' trainer
  and engine on disjoint cores (pinned, as on GPUs) or ``shared`` (the OS schedules both on every core);
- ``raygym_vs_trl_step_s`` / ``raygym_async_vs_trl_step_s`` / ``raygym_fully_async_vs_trl_step_s``: raygym's
  step time against TRL's
  ``GRPOTrainer`` on the same task, model, group size, prompts per step, response length and learning
  rate, run on the same machine in the same run, once before and once after raygym's runs (baseline: their
  mean; ``trl.spread``: how far the machine drifted) (goal: ratio <= 1.0; fully async <= 0.8).
  TRL's own asynchronous trainer (``trl.experimental.async_grpo``) streams weights to a vLLM server over NCCL,
  which needs CUDA; it is not run here.

TRL is not a raygym dependency: it runs in its own interpreter, ``--trl-python`` (default: the
``TRL_PYTHON`` environment variable; without either, the TRL figures are skipped with a message).
Create that interpreter once with::

    python -m venv --system-site-packages .venv-trl && .venv-trl/bin/pip install trl

    raygym bench e2e --steps 12 --models ref,tiny --trl-python .venv-trl/bin/python
    raygym bench e2e --steps 8 --models compute --tasks long-tail,next-digit --modes sync \
        --trl-python .venv-trl/bin/python

``--address`` runs raygym's side on an existing Ray cluster instead of a local one; ``--preset`` names the recipe
raygym's runs and TRL's start from (default ``tiny``; the model is the size's either way).

Every figure carries ``model`` (the size's name), ``params`` and the setup.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.bench.common import raygym_on_path

if TYPE_CHECKING:
    from raygym import Recipe

PHASES = ("rollout", "log_probs", "train", "sync", "eval", "other")


def machine() -> dict[str, Any]:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"cores": os.cpu_count(), "device": device, "torch": torch.__version__,
            "python": platform.python_version(), "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}


# name -> (Qwen3 architecture overrides of raygym.builtin.TINY_ARCH, max new tokens)
MODEL_SIZES: dict[str, tuple[dict[str, Any], int]] = {
    "ref": ({"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 4, "head_dim": 64}, 16),
    "compute": ({"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1024, "num_attention_heads": 6,
                 "num_key_value_heads": 6, "head_dim": 64}, 64),
    "tiny": ({}, 8),
}
TASKS = ("next-digit", "long-tail")
REWARD_TYPES = {"next-digit": "next_digit", "long-tail": "long_tail"}


def write_model(name: str, directory: Path) -> tuple[str, int]:
    """The checkpoint directory of model size ``name`` (random weights, seed 0) and its parameter count."""
    from raygym.builtin import TINY_MODEL, build_tiny_model, materialize_model

    arch, _ = MODEL_SIZES[name]
    path = materialize_model(TINY_MODEL, directory / name, seed=0, **arch)
    model, _ = build_tiny_model(0, **arch)
    return path, sum(p.numel() for p in model.parameters())


def bench_recipe(max_new_tokens: int, task: str = "next-digit", preset: str = "tiny", **overrides: Any) -> Recipe:
    from raygym import Recipe
    from raygym.presets import get_preset

    # calculate_per_token_loss: the loss of TRL's GRPOTrainer by default (loss_type="dapo": every token of the
    # batch weighs the same); raygym's default weighs every sample the same. Same loss on both sides.
    fields = {**get_preset(preset).model_dump(), "save_interval": 10**6, "rollout_max_response_len": max_new_tokens,
              "eval_max_response_len": max_new_tokens, "rm_type": REWARD_TYPES[task],
              "calculate_per_token_loss": True, **overrides}
    return Recipe(**fields)


def bench_config(out: Path, model_path: str, recipe: Any, task: str = "next-digit"):
    from raygym import DatasetConfig, ModelConfig, TrainConfig

    return TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=model_path),
                       dataset=DatasetConfig(prompt_data=f"builtin:{task}"), output_dir=str(out))


def split(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Mean seconds per step of each phase over the rows after ``warmup``."""
    measured = rows[warmup:] or rows

    def mean(key: str) -> float:
        return sum(float(r.get(key) or 0.0) for r in measured) / len(measured)

    out = {"step_s": mean("perf/step_time"), "measured_steps": len(measured)}
    for phase in PHASES:
        out[f"{phase}_s"] = mean(f"perf/{phase}_time")
    # time spent moving memory (colocate) and saving is neither control overhead nor a named phase above
    out["offload_save_wait_s"] = mean("perf/offload_time") + mean("perf/save_time") + mean("perf/rollout_wait_time")
    out["other_frac"] = out["other_s"] / out["step_s"] if out["step_s"] else 0.0
    out["response_len_mean"] = mean("rollout/response_len_mean")  # what continuous batching and packing act on
    out["reward_first"] = float(rows[0]["rollout/reward_mean"])
    out["reward_last"] = float(rows[-1]["rollout/reward_mean"])
    return out


def run_raygym(mode: str, steps: int, work: Path, model_path: str, max_new_tokens: int,
               task: str = "next-digit", placement: str = "disjoint", preset: str = "tiny") -> list[dict[str, Any]]:
    from raygym.run.driver import train

    recipe = bench_recipe(max_new_tokens, task, preset, num_rollout=steps, cpu_placement=placement,
                          async_mode=(mode == "async"),
                          fully_async=(mode == "fully_async"), use_tis=(mode != "sync"))  # TIS: the off-policy default
    with contextlib.redirect_stdout(sys.stderr):  # progress lines to stderr: stdout carries only JSON lines
        result = train(bench_config(work / mode, model_path, recipe, task))
    return result.steps


def run_trl(python: str, model_dir: str, steps: int, warmup: int, recipe: Any, task: str) -> dict[str, Any]:
    """``raygym.bench.trl_baseline`` in TRL's interpreter, importing this raygym (its package alone on the path)."""
    argv = [python, "-m", "raygym.bench.trl_baseline", "--model-dir", model_dir, "--task", task,
            "--prompts", str(recipe.rollout_batch_size), "--group", str(recipe.n_samples_per_prompt),
            "--max-new-tokens", str(recipe.rollout_max_response_len), "--lr", str(recipe.lr),
            "--steps", str(steps), "--warmup", str(warmup), "--seed", str(recipe.seed)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with raygym_on_path() as path:
        env["PYTHONPATH"] = path
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"trl_baseline failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(figure: str, info: dict[str, Any], **values: Any) -> None:
    print(json.dumps({"figure": figure, **values, "machine": info}), flush=True)


def bench_model(name: str, task: str, work: Path, args: argparse.Namespace, info: dict[str, Any]) -> None:
    """Every figure of model size ``name`` on ``task``: TRL, raygym per mode, TRL again; async vs sync; raygym
    vs TRL, step time, phase by phase, and samples/s.

    TRL runs before and after raygym and its baseline is the mean of the two, so a machine that drifts
    during the benchmark (a shared 2-core VM measured the same decode at 0.25-0.45 s within an hour)
    moves both sides of the ratio; ``trl.spread`` (slower / faster run) says how much it drifted."""
    model_path, params = write_model(name, work / "models")
    max_new_tokens = MODEL_SIZES[name][1]
    recipe = bench_recipe(max_new_tokens, task, args.preset)
    samples = recipe.rollout_batch_size * recipe.n_samples_per_prompt
    setup = {"model": name, "params": params, "task": f"builtin:{task}", "prompts": recipe.rollout_batch_size,
             "group": recipe.n_samples_per_prompt, "max_new_tokens": max_new_tokens, "lr": recipe.lr,
             "cpu_placement": args.placement, "preset": args.preset}
    trl_runs = [run_trl(args.trl_python, model_path, args.steps, args.warmup, recipe, task)] if args.trl_python else []
    results: dict[str, dict[str, float]] = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        rows = run_raygym(mode, args.steps, work, model_path, max_new_tokens, task, args.placement, args.preset)
        results[mode] = split(rows, args.warmup)
        emit(f"raygym_step_split_{mode}", info, **results[mode], setup=setup)
    for mode in ("async", "fully_async"):
        if "sync" in results and mode in results:
            emit(f"{mode}_vs_sync_step_s", info, value=results[mode]["step_s"], baseline=results["sync"]["step_s"],
                 ratio=results[mode]["step_s"] / results["sync"]["step_s"],
                 samples_per_s_ratio=results["sync"]["step_s"] / results[mode]["step_s"], setup=setup)
    if not args.trl_python:
        print("# TRL figures skipped: pass --trl-python or set TRL_PYTHON (see raygym bench e2e --help)",
              file=sys.stderr)
        return
    trl_runs.append(run_trl(args.trl_python, model_path, args.steps, args.warmup, recipe, task))
    seconds = [r["trl_seconds_per_step"] for r in trl_runs]
    base = sum(seconds) / len(seconds)
    trl = {"trl_seconds_per_step": base, "runs": trl_runs, "spread": max(seconds) / min(seconds)}
    trl_phases = {k: sum(r["phases"][k] for r in trl_runs) / len(trl_runs) for k in trl_runs[0]["phases"]}
    raygym_sync = results.get("sync", {})
    emit("trl_step_split", info, step_s=base, **trl_phases, samples_per_s=samples / base,
         raygym_sync={k: raygym_sync[k] for k in ("step_s", "rollout_s", "train_s", "sync_s", "other_s")
                      if k in raygym_sync},
         raygym_sync_samples_per_s=samples / raygym_sync["step_s"] if raygym_sync else None,
         samples_per_s_ratio=base / raygym_sync["step_s"] if raygym_sync else None, setup=setup)
    for mode, figure in (("sync", "raygym_vs_trl_step_s"), ("async", "raygym_async_vs_trl_step_s"),
                         ("fully_async", "raygym_fully_async_vs_trl_step_s")):
        if mode in results:
            emit(figure, info, value=results[mode]["step_s"], baseline=base, ratio=results[mode]["step_s"] / base,
                 trl=trl, setup=setup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"),
                   help="interpreter with trl installed (default: $TRL_PYTHON; unset = skip TRL)")
    p.add_argument("--modes", default="sync,async,fully_async", help="comma-separated: sync, async, fully_async")
    p.add_argument("--models", default="ref,tiny", help=f"comma-separated model sizes: {', '.join(MODEL_SIZES)}")
    p.add_argument("--tasks", default="next-digit", help=f"comma-separated builtin tasks: {', '.join(TASKS)}")
    p.add_argument("--placement", default="disjoint", choices=("disjoint", "shared"),
                   help="cpu_placement of the raygym runs: async trainer and engine on disjoint cores, or shared")
    p.add_argument("--address", default="", help="an existing Ray cluster for raygym's runs (default: a local Ray)")
    p.add_argument("--preset", default="tiny", help="the recipe raygym's and TRL's runs start from (raygym's presets)")
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    info = machine()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODEL_SIZES))
    if unknown:
        p.error(f"--models: unknown size(s) {unknown}; use {', '.join(MODEL_SIZES)}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if unknown_tasks := sorted(set(tasks) - set(TASKS)):
        p.error(f"--tasks: unknown task(s) {unknown_tasks}; use {', '.join(TASKS)}")
    if args.address:  # one Ray for every run: train() attaches to it
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2) + 4, num_gpus=4, include_dashboard=False,
                 log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="raygym-bench-e2e-") as tmp:
            for name in models:
                for task in tasks:
                    bench_model(name, task, Path(tmp) / name / task, args, info)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
