"""Multi-node figures on one machine: runs submitted as Ray jobs to clusters of separate nodes, each node its own
network namespace (``scripts/local_cluster.py`` of a raygym checkout: run from its root; needs root). One JSON
object per line:

1. ``step_time_3_nodes_vs_1``: median step time of the tiny disaggregated run (1 trainer, 2 engines) with the
   trainer and each engine on its own node, against the same run with all three on one node (the driver and the
   rollout manager on a CPU head in both);
2. ``step_time_delta_vs_full_1gbit``: the trainer node's link shaped to 1 Gbit/s each way (tc), a larger model
   (``--sync-model``: the ``ref`` size of raygym.bench.e2e), ``update_weight_mode`` delta against full: step
   and sync times, wire bytes;
3. ``engine_node_recovery``: an engine node killed mid-rollout and started again at once: seconds until the head
   declared it dead, until it rejoined, and until the run trained a step at full engine count again, from the
   kill and from its return.

Numbers vary with the machine's load (reported); the ratios are measured in the same run.

    sudo python -m raygym.bench.multinode [--steps 12] [--skip sync,recovery]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scripts.local_cluster import LocalCluster

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
REF_ARCH: dict[str, Any] = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
                            "num_attention_heads": 4, "num_key_value_heads": 4,
                            "head_dim": 64}  # raygym.bench.e2e's "ref" size
MACHINE = {"cores": os.cpu_count(), "device": "cpu (logical GPUs)", "platform": platform.platform()}


def emit(figure: str, **values: Any) -> None:
    row = {"figure": figure, **{k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}}
    row["machine"] = {**MACHINE, "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(row), flush=True)


def run_args(steps: int, batch: int = 8, response_len: int = 32, **flags: str) -> list[str]:
    args = ["--preset", "tiny", "--rollout-num-gpus", "2", "--num-rollout", str(steps), "--rollout-batch-size",
            str(batch), "--n-samples-per-prompt", "8", "--global-batch-size", str(batch * 8),
            "--rollout-max-response-len", str(response_len), "--save-interval", "100000"]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", value]
    return args


def run_job(cluster: LocalCluster, out: Path, args: list[str],
            on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> list[tuple[float, dict[str, Any]]]:
    """Submit one run and follow it; returns (when it appeared, metrics row) per step."""
    from ray.job_submission import JobSubmissionClient

    from raygym.launchers.ray_job import submit_train_job

    outcome = submit_train_job(cluster.dashboard_url, [*args, "--output-dir", str(out)], environ=cluster.env,
                               working_dir=None, follow=False, out=lambda line: print(line, file=sys.stderr))
    client = JobSubmissionClient(cluster.dashboard_url)
    seen: list[tuple[float, dict[str, Any]]] = []
    path = out / "metrics.jsonl"
    while True:
        status = str(client.get_job_status(outcome.job_id).value)
        lines = [ln for ln in path.read_text().splitlines() if ln.endswith("}")] if path.exists() else []
        if len(lines) > len(seen):
            now = time.monotonic()
            seen += [(now, json.loads(ln)) for ln in lines[len(seen):]]
            if on_rows is not None:
                on_rows([r for _, r in seen])
        if status in TERMINAL:
            break
        time.sleep(0.05)
    if status != "SUCCEEDED":
        raise RuntimeError(f"job {outcome.job_id} {status}:\n{client.get_job_logs(outcome.job_id)[-4000:]}")
    return seen


def median_of(rows: list[dict[str, Any]], key: str, warmup: int) -> float:
    return statistics.median(float(r[key]) for r in rows[warmup:] or rows)


def step_times(cluster3: LocalCluster, cluster1: LocalCluster, work: Path, args: argparse.Namespace) -> None:
    run = run_args(args.steps)
    three = [r for _, r in run_job(cluster3, work / "three", run)]
    one = [r for _, r in run_job(cluster1, work / "one", run)]
    value, base = median_of(three, "perf/step_time", args.warmup), median_of(one, "perf/step_time", args.warmup)
    emit("step_time_3_nodes_vs_1", value=value, baseline=base, ratio=value / base, unit="s",
         ratio_is="median step time, trainer and 2 engines on 3 nodes / on 1 node", steps=args.steps,
         warmup=args.warmup, sync_s=median_of(three, "perf/sync_time", args.warmup),
         sync_s_one_node=median_of(one, "perf/sync_time", args.warmup),
         rollout_s=median_of(three, "perf/rollout_time", args.warmup),
         rollout_s_one_node=median_of(one, "perf/rollout_time", args.warmup))


def sync_modes(cluster: LocalCluster, work: Path, args: argparse.Namespace) -> None:
    from raygym.builtin import TINY_MODEL, build_tiny_model, materialize_model

    model = materialize_model(TINY_MODEL, work / "models", seed=0, **REF_ARCH)
    params = sum(p.numel() for p in build_tiny_model(0, **REF_ARCH)[0].parameters())
    shaping = cluster.shape("w1", 1.0)  # every weight byte leaves the trainer's node
    try:
        rows = {mode: [r for _, r in run_job(cluster, work / f"sync-{mode}",
                                             run_args(args.steps, hf_checkpoint=model, update_weight_mode=mode))]
                for mode in ("full", "delta")}
    finally:
        cluster.shape("w1", None)
    full, delta = rows["full"], rows["delta"]
    step, step_full = median_of(delta, "perf/step_time", args.warmup), median_of(full, "perf/step_time", args.warmup)
    sync, sync_full = median_of(delta, "perf/sync_time", args.warmup), median_of(full, "perf/sync_time", args.warmup)
    emit("step_time_delta_vs_full_1gbit", value=step, baseline=step_full, ratio=step / step_full, unit="s",
         ratio_is="median step time, update_weight_mode delta / full, trainer link 1 Gbit/s", link=shaping,
         model_params=params, sync_s=sync, sync_s_full=sync_full, sync_ratio=sync / sync_full,
         wire_bytes=median_of(delta, "sync/bytes", args.warmup),
         wire_bytes_full=median_of(full, "sync/bytes", args.warmup),
         changed_frac=median_of(delta, "sync/changed_frac", args.warmup), steps=args.steps, warmup=args.warmup)


def recovery(cluster: LocalCluster, work: Path, args: argparse.Namespace) -> None:
    marks: dict[str, float] = {}
    kill_after = 3

    def on_rows(rows: list[dict[str, Any]]) -> None:
        if len(rows) == kill_after and "kill" not in marks:  # the next step's rollout is in flight
            marks["kill"] = time.monotonic()
            cluster.kill_node("w2")
            marks["declared_dead"] = marks["kill"] + cluster.wait_dead("w2")
            cluster.start_node("w2")
            marks["rejoined"] = time.monotonic()

    seen = run_job(cluster, work / "recovery", run_args(args.recovery_steps), on_rows)
    after = [(t, r) for t, r in seen if r["step"] >= kill_after]
    degraded = [r["step"] for _, r in after if r["sync/engines"] < 2]
    full = next(((t, r) for t, r in after if degraded and r["step"] > degraded[0] and r["sync/engines"] == 2), None)
    if full is None:
        emit("engine_node_recovery", value=-1.0, unit="s", note="the engine did not come back before the run ended",
             steps=args.recovery_steps)
        return
    emit("engine_node_recovery", value=full[0] - marks["kill"], unit="s",
         value_is="seconds from the engine node's death to a step trained with both engines again",
         from_return_s=full[0] - marks["rejoined"], declared_dead_s=marks["declared_dead"] - marks["kill"],
         rejoined_s=marks["rejoined"] - marks["kill"], steps_on_one_engine=len(degraded),
         retried_requests=sum(r["rollout/request_retries"] for _, r in seen),
         samples_per_step=sorted({r["rollout/samples"] for _, r in seen}), steps=args.recovery_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recovery-steps", type=int, default=40)
    p.add_argument("--skip", default="", help="comma separated: steps, sync, recovery")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    try:  # the checkout's helper that builds clusters of network namespaces, not part of the package
        from scripts.local_cluster import LocalCluster, remove_stale, unavailable
    except ImportError:
        p.error("needs scripts/local_cluster.py of a raygym checkout: run it from the checkout's root "
                "(sudo python -m raygym.bench.multinode)")
    why = unavailable()
    if why:
        emit("multinode_skipped", value=0.0, unit="", reason=why)
        return
    remove_stale()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = Path(tempfile.mkdtemp(prefix="rgm-bench-"))
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        with LocalCluster((1, 1, 1), say=say) as three:
            if "steps" not in skip:
                with LocalCluster((3,), say=say) as one:
                    step_times(three, one, work, args)
            if "sync" not in skip:
                sync_modes(three, work, args)
            if "recovery" not in skip:
                recovery(three, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
