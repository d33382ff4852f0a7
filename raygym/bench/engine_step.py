"""A verified training step with each engine kind: ``raygym train --preset tiny`` (every sync verified) with raygym's
own server (the baseline, measured in the same run), stock SGLang (with and without ``--sleep-on-idle``) and vLLM's
CPU build; the median step and its phases, and each engine's step as a ratio of the baseline's.

    raygym bench engine_step --steps 30 --sglang-python PY --vllm-python PY

One JSON line per engine; an engine whose interpreter is not given is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PHASES = ("perf/step_time", "perf/rollout_time", "perf/train_time", "perf/sync_time")


def run(name: str, flags: list[str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / name
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rgbench-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "raygym", "train", "--preset", "tiny", "--hf-checkpoint", args.model,
           "--num-rollout", str(args.steps), "--save-interval", str(10**6), *flags, "--output-dir", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: raygym train failed\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup:]
    return {phase: statistics.median(r[phase] for r in steady) for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--sglang-python", default=os.environ.get("RAYGYM_SGLANG_PYTHON", ""))
    parser.add_argument("--vllm-python", default=os.environ.get("RAYGYM_VLLM_PYTHON", ""))
    args = parser.parse_args()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    with tempfile.TemporaryDirectory(prefix="raygym-engine-step-") as tmp:
        work = Path(tmp)
        from raygym.builtin import TINY_MODEL, materialize_model

        # the tiny preset's model with a head size vLLM's CPU attention runs, the same for every engine
        args.model = materialize_model(TINY_MODEL, work / "model", seed=0, head_dim=32)
        engines: list[tuple[str, list[str], str]] = [("raygym", [], "")]
        for kind, python in (("sglang", args.sglang_python), ("vllm", args.vllm_python)):
            if not python:
                print(json.dumps({"figure": "verified_step_s", "engine": kind,
                                  "skipped": f"no interpreter: pass --{kind}-python"}), flush=True)
                continue
            flags = ["--rollout-engine", kind, "--rollout-engine-python", python]
            engines.append((kind, flags, ""))
            if kind == "sglang":
                engines.append(("sglang-busy-idle", [*flags, "--sglang-config", '{"sleep_on_idle": false}'],
                                "SGLang's scheduler busy-polling while idle (its default)"))
        baseline: dict[str, Any] | None = None
        for name, flags, note in engines:
            figures = run(name, flags, args, work)
            baseline = baseline or figures
            ratio = figures["perf/step_time"] / baseline["perf/step_time"]
            print(json.dumps({"figure": "verified_step_s", "engine": name, "steps": args.steps, "warmup": args.warmup,
                              **{k.removeprefix("perf/"): round(v, 4) for k, v in figures.items()},
                              "value": round(figures["perf/step_time"], 4),
                              "baseline": round(baseline["perf/step_time"], 4), "baseline_name": "raygym's server",
                              "ratio": round(ratio, 3), "step_vs_raygym": round(ratio, 2),
                              **({"note": note} if note else {}), "machine": machine}), flush=True)


if __name__ == "__main__":
    main()
