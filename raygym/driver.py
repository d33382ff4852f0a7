"""The training loop: ``train(TrainConfig) -> TrainResult``.

Synchronous (default) per step: rollout -> [colocate: engines release, trainers onload] -> log-probs
-> advantages -> train -> save/eval -> [colocate: trainers offload, engines resume] -> weight sync.
``async_mode``: the rollout of step k+1 runs while step k trains (one step off-policy; each sample
carries the weight version that generated it, never more than one behind).

>>> from raygym import TrainConfig, train                   # doctest: +SKIP
>>> from raygym.presets import tiny                          # doctest: +SKIP
>>> result = train(TrainConfig(recipe=tiny(), model=..., dataset=...))   # doctest: +SKIP
>>> result.final_step, result.metrics_path                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raygym.errors import RaygymError
from raygym.metrics import MetricsLogger, PhaseTimer, plot_reward_curve, progress_line, summary_table

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    run_dir: str
    metrics_path: str
    final_step: int  # last completed rollout id (-1 when no step ran)
    checkpoint_paths: list[str] = field(default_factory=list)
    hf_export_path: str | None = None
    reward_curve_path: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per step of this run


def _console():
    from rich.console import Console

    return Console(highlight=False)


def connect_ray(total_gpus: int) -> bool:
    """Attach to the Ray of this process, of ``RAY_ADDRESS`` (``ray job submit``), or start a local one.

    Returns True when this call started Ray (so the run shuts it down at the end). On a machine
    without GPUs a local Ray gets ``total_gpus`` logical GPUs, so placement behaves as on a GPU node.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else total_gpus
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, 2) + total_gpus,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=os.environ.get("RAYGYM_WORKER_LOGS", "0") == "1",
    )
    return True


def _should(interval: int | None, step: int, last_step: int) -> bool:
    return bool(interval) and ((step + 1) % interval == 0 or step == last_step)


class Loop:
    """One run's loop over a built :class:`raygym.graph.RunGraph`."""

    def __init__(self, cfg: Any, graph: Any, console: Any) -> None:
        self.cfg = cfg
        self.recipe = cfg.recipe
        self.graph = graph
        self.console = console
        self.metrics: MetricsLogger | None = None
        self.checkpoints: list[str] = []
        self.version = 0  # policy version the engines serve (= optimizer updates applied so far, by rollout)
        self.rows: list[dict[str, Any]] = []

    # ---- phases ---------------------------------------------------------------------------------
    def _trainers(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(h, method).remote(*args) for h in self.graph.trainers.handles])

    def _engines(self, method: str, **kwargs: Any) -> None:
        import ray

        ray.get([h.call.remote(method, **kwargs) for h in self.graph.engines.handles])

    def resume(self) -> int:
        """Load the newest complete checkpoint of ``load`` (if any); returns the first rollout id to run."""
        import ray

        start = self.recipe.start_rollout_id or 0
        if not self.recipe.load:
            return start
        infos = self._trainers("load_checkpoint")
        info = infos[0]
        if info is None:
            self.console.print(f"[yellow]load={self.recipe.load!r}: no complete checkpoint; starting fresh[/]")
            return start
        extra = info.get("extra") or {}
        if extra.get("data_state") is not None:
            ray.get(self.graph.manager.load_data_state.remote(extra["data_state"]))
        self.version = int(info["start_rollout_id"])
        self.console.print(f"resumed from {info['path']} (rollout {info['rollout_id']}); "
                           f"continuing at step {info['start_rollout_id']}")
        # The engines still hold the initial weights: give them the checkpoint's.
        self.graph.weight_sync.push(self.version)
        return int(info["start_rollout_id"])

    def train_on(self, samples: list[Any], step: int, timer: PhaseTimer) -> dict[str, float]:
        import ray

        from raygym.trainer.batch import TrainBatch

        recipe = self.recipe
        if recipe.colocate:
            with timer.phase("offload"):
                self._engines("release_memory_occupation")
                self._trainers("onload")
        batch = TrainBatch.from_samples(samples, group_size=recipe.n_samples_per_prompt)
        with timer.phase("log_probs"):
            ref = ray.put(batch)
            log_probs = ray.get([h.compute_log_probs.remote(ref, step) for h in self.graph.trainers.handles])[0]
        batch = batch.with_log_probs(log_probs).with_advantages(
            recipe.advantage_estimator, kl_coef=recipe.kl_coef, gamma=recipe.gamma, lambd=recipe.lambd
        )
        with timer.phase("train"):
            ref = ray.put(batch)
            train_metrics = ray.get([h.train_step.remote(ref, step) for h in self.graph.trainers.handles])[0]
        return {**train_metrics, **_advantage_stats(batch)}

    def save(self, step: int, data_state: dict[str, Any]) -> None:
        extra = {"data_state": data_state, "weight_version": self.version, "run_id": self.cfg.run_id}
        paths = self._trainers("save_checkpoint", step, extra, self.cfg.checkpoint_dir)
        self.checkpoints.append(paths[0])

    def sync(self, version: int, timer: PhaseTimer) -> dict[str, float]:
        import ray

        if self.recipe.colocate:
            with timer.phase("offload"):
                self._trainers("offload")
                self._engines("resume_memory_occupation")
        with timer.phase("sync"):
            out = self.graph.weight_sync.push(version)
            self.version = version
            # Engines restarted by fault tolerance got the full push above: put them back in rotation.
            for i in ray.get(self.graph.manager.engines_needing_weights.remote()):
                ray.get(self.graph.manager.mark_engine_synced.remote(i, version))
        return out

    def evaluate(self, step: int, timer: PhaseTimer) -> dict[str, float]:
        import ray

        with timer.phase("eval"):
            return ray.get(self.graph.manager.evaluate.remote(step))

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, start: int, metrics: MetricsLogger) -> int:
        """Run steps ``start .. num_rollout-1``; returns the last completed step."""
        import ray

        self.metrics = metrics
        recipe = self.recipe
        last = recipe.num_rollout - 1
        manager = self.graph.manager
        pending = manager.generate.remote(start, self.version) if start <= last else None
        final = start - 1
        for step in range(start, last + 1):
            timer = PhaseTimer()
            t0 = time.perf_counter()
            with timer.phase("rollout"):
                samples = ray.get(pending)
            rollout_metrics = ray.get(manager.metrics.remote())
            data_state = ray.get(manager.data_state.remote())
            pending = None
            if recipe.async_mode and step < last:
                pending = manager.generate.remote(step + 1, self.version)  # overlaps training below
            row: dict[str, Any] = dict(rollout_metrics)
            row["rollout/weight_version_min"] = min(s.weight_version for s in samples)
            row["rollout/staleness_max"] = self.version - row["rollout/weight_version_min"]
            row.update(self.train_on(samples, step, timer))
            if recipe.async_mode and pending is not None:
                with timer.phase("rollout_wait"):
                    ray.wait([pending])  # the next rollout must finish on the old weights before the sync
            if _should(recipe.save_interval, step, last):
                with timer.phase("save"):
                    self.save(step, data_state)
            row.update(self.sync(step + 1, timer))
            if recipe.eval_interval and (step + 1) % recipe.eval_interval == 0:
                row.update(self.evaluate(step, timer))
            if not recipe.async_mode and step < last:
                pending = manager.generate.remote(step + 1, self.version)
            row.update(timer.as_metrics())
            row["perf/step_time"] = time.perf_counter() - t0
            row.setdefault("perf/rollout_time", 0.0)
            row.setdefault("perf/train_time", 0.0)
            row.setdefault("perf/sync_time", 0.0)
            phases = sum(v for k, v in timer.seconds.items() if k != "rollout_wait")
            row["perf/other_time"] = max(0.0, row["perf/step_time"] - phases)
            tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
            row["perf/tokens_per_s"] = tokens / row["perf/step_time"]
            self._log_hooks(samples, step, row)
            logged = self.metrics.log(step, row)
            self.rows.append(logged)
            self.console.print(progress_line(logged, recipe.num_rollout))
            final = step
        return final

    def _log_hooks(self, samples: list[Any], step: int, row: dict[str, Any]) -> None:
        from raygym.config import load_callable

        spec = self.recipe.custom_rollout_log_function
        if spec:
            load_callable(spec, "custom_rollout_log_function")(step, samples, row)


def _advantage_stats(batch: Any) -> dict[str, float]:
    import torch

    if not batch.advantages:
        return {}
    flat = torch.cat([a.float() for a in batch.advantages]) if batch.advantages else torch.zeros(0)
    if flat.numel() == 0:
        return {}
    return {"train/adv_mean": flat.mean().item(), "train/adv_std": flat.std().item() if flat.numel() > 1 else 0.0,
            "train/adv_abs_max": flat.abs().max().item()}


def _hf_export_of(checkpoint: str) -> str | None:
    import fsspec

    path = checkpoint.rstrip("/") + "/hf"
    fs, root = fsspec.core.url_to_fs(path)
    return path if fs.exists(root) else None


def train(cfg: Any) -> TrainResult:
    """Run RL post-training as described by ``cfg`` (a :class:`raygym.TrainConfig`).

    Starts a local Ray when none is connected (or joins ``RAY_ADDRESS``), builds the graph, runs
    ``num_rollout`` steps, and always releases every actor and placement group it started — also on
    Ctrl-C or an actor's death, which is re-raised as :class:`raygym.errors.RaygymError` naming the
    actor and the last complete checkpoint.
    """
    import ray

    from raygym.graph import build_graph, raise_actor_death, resolve_model_path

    console = _console()
    recipe = cfg.recipe
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model.hf_checkpoint, run_dir / "cache", seed=0)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_checkpoint": model_path})})
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json_dict(), indent=2, default=str) + "\n")
    console.print(f"[bold]raygym[/] run {cfg.run_id} -> {run_dir}")

    owns_ray = connect_ray(recipe.gpu_allocation().total_gpus)
    graph = None
    loop = None
    final = -1
    try:
        graph = build_graph(cfg, model_path, run_dir, say=console.print)
        loop = Loop(cfg, graph, console)
        start = loop.resume()
        with MetricsLogger(run_dir, cfg.metrics, run_id=cfg.run_id, config_dict=cfg.to_json_dict(),
                           resume_from_step=start if recipe.load else None) as metrics:
            final = loop.run(start, metrics)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
        raise_actor_death(exc, graph, loop.checkpoints[-1] if loop and loop.checkpoints else None)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: releasing actors and placement groups[/]")
        raise
    finally:
        if graph is not None:
            graph.shutdown()
        if owns_ray:
            ray.shutdown()

    history = loop.metrics.history if loop and loop.metrics else []
    curve = plot_reward_curve(history, run_dir / "reward_curve.png")
    if history:
        console.print(summary_table(history, title=f"raygym run {cfg.run_id}"))
    if curve:
        console.print(f"reward curve: {curve}")
    return TrainResult(
        run_dir=str(run_dir),
        metrics_path=str(run_dir / "metrics.jsonl"),
        final_step=final,
        checkpoint_paths=list(loop.checkpoints) if loop else [],
        hf_export_path=_hf_export_of(loop.checkpoints[-1]) if loop and loop.checkpoints else None,
        reward_curve_path=curve,
        steps=list(loop.rows) if loop else [],
    )


__all__ = ["TrainResult", "train", "RaygymError"]
