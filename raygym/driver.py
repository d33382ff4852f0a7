"""The training loop: ``train(TrainConfig) -> TrainResult``.

Synchronous (default) per step: rollout -> [colocate: engines release memory, trainers onload] ->
log-probs -> advantages -> train -> save every ``save_interval`` -> [colocate: trainers offload, engines
resume their weights] -> weight sync (verified on every engine) -> [colocate: engines resume the KV
cache] -> eval every ``eval_interval`` -> the next rollout starts -> metrics row, hooks, progress line.
``async_mode``: the rollout of step k+1 runs while step k trains (one step off-policy; each sample
carries the weight version that generated it, never more than one behind).

Sampling is reproducible: the rollout manager gives every request a ``sampling_seed`` derived from
(``seed``, step, group, sample), so a run resumed from a checkpoint samples what an uninterrupted run
did (sync mode; an async resume regenerates its first step with the checkpoint's newer weights).

>>> from raygym import TrainConfig, train                   # doctest: +SKIP
>>> from raygym.presets import tiny                          # doctest: +SKIP
>>> result = train(TrainConfig(recipe=tiny(), model=..., dataset=...))   # doctest: +SKIP
>>> result.final_step, result.metrics_path                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raygym.errors import ConfigError, RaygymError, WeightSyncError
from raygym.metrics import (
    MetricsLogger,
    PhaseTimer,
    apply_substep_timing,
    loss_note,
    plot_reward_curve,
    progress_line,
    summary_table,
    write_traces,
)
from raygym.run_display import StepProgress, banner_lines

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
    events: list[str] = field(default_factory=list)  # phase order, see Loop.events

    def __repr__(self) -> str:
        ran = (f"steps {self.steps[0]['step']}-{self.steps[-1]['step']}" if self.steps else "no steps")
        last = self.checkpoint_paths[-1] if self.checkpoint_paths else None
        return (f"TrainResult(run_dir={self.run_dir!r}, final_step={self.final_step}, {ran} this run, "
                f"checkpoints={len(self.checkpoint_paths)} (last {last!r}), hf_export_path={self.hf_export_path!r}, "
                f"metrics_path={self.metrics_path!r})")


def _console():
    from rich.console import Console

    return Console(highlight=False)


def connect_ray(total_gpus: int, stack: ExitStack | None = None) -> bool:
    """Attach to the Ray of this process, of ``RAY_ADDRESS`` (``ray job submit``), or start a local one.

    Returns True when this call started Ray (so the run shuts it down at the end). On a machine
    without GPUs a local Ray gets ``total_gpus`` logical GPUs, so placement behaves as on a GPU node.
    A local Ray started here keeps token auth with a private token (:mod:`raygym.ray_auth`), entered on
    ``stack``, which the caller closes after ``ray.shutdown()``.
    """
    import ray

    from raygym.ray_auth import private_cluster_auth

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else total_gpus
    if stack is not None:
        stack.enter_context(private_cluster_auth())
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, 2) + total_gpus,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=os.environ.get("RAYGYM_WORKER_LOGS", "0") == "1",
    )
    return True


def _banner(cfg: Any, facts: Any) -> list[str]:
    """The start-up banner (:func:`raygym.run_display.banner_lines`) with the resolved trainer backend
    and engine kind."""
    import torch

    from raygym.graph import choose_rollout_engine
    from raygym.trainer.actor import choose_backend

    local = not os.environ.get("RAY_ADDRESS")
    return banner_lines(cfg, facts, trainer_backend=choose_backend(cfg.recipe.trainer_backend),
                        engine_kind=choose_rollout_engine(cfg.recipe.rollout_engine),
                        logical_gpus=local and not torch.cuda.is_available())


def _should(interval: int | None, step: int, last_step: int) -> bool:
    return bool(interval) and ((step + 1) % interval == 0 or step == last_step)


def _eval_due(interval: int | None, step: int) -> bool:
    """Eval after the sync of every ``eval_interval``-th step (a property of the step, not of the run's
    length, so a resumed run evaluates at the same steps as an uninterrupted one)."""
    return bool(interval) and (step + 1) % interval == 0


def _call_log_hook(spec: Any, field_name: str, step: int, samples: Any, row: dict[str, Any]) -> None:
    """Call a ``custom_*_log_function`` as ``fn(rollout_id, samples, metrics_row)``; a returned mapping
    is merged into the row (extra metrics to log)."""
    from raygym.config import load_callable

    extra = load_callable(spec, field_name)(step, samples, row)
    if isinstance(extra, dict):
        row.update(extra)


class Loop:
    """One run's loop over a built :class:`raygym.graph.RunGraph`.

    ``events`` records the order of the phases that move memory and weights, as ``"<step>:<what>"``
    (colocated: ``"0:engines.release"``, ``"0:trainers.onload"``, ``"0:train"``, ``"0:trainers.offload"``,
    ``"0:engines.resume_weights"``, ``"0:sync"``, ``"0:engines.resume_kv_cache"``; otherwise ``"0:train"``,
    ``"0:sync"``) so operators and tests can audit the colocated choreography.
    """

    def __init__(self, cfg: Any, graph: Any, console: Any) -> None:
        self.cfg = cfg
        self.recipe = cfg.recipe
        self.graph = graph
        self.console = console
        self.run_dir = Path(cfg.run_dir)
        self.metrics: MetricsLogger | None = None
        self.checkpoints: list[str] = []
        self.version = 0  # policy version the engines serve (= optimizer updates applied so far, by rollout)
        self.rows: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.engine_rebuilds = 0  # weight-sync rebuilds after engine restarts
        self.progress: Any = None  # raygym.run_display.StepProgress; None prints plain step lines

    # ---- phases ---------------------------------------------------------------------------------
    @staticmethod
    def _call(groups: tuple[Any, ...], method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every rank of ``groups`` (ActorGroups; None = absent) at once, results in order."""
        import ray

        return ray.get([getattr(h, method).remote(*args) for g in groups if g is not None for h in g.handles])

    def _trainers(self, method: str, *args: Any) -> list[Any]:
        return self._call((self.graph.trainers,), method, *args)

    def _critics(self, method: str, *args: Any) -> list[Any]:
        """Every critic rank (PPO); ``[]`` when the run has no critic."""
        return self._call((self.graph.critics,), method, *args)

    def _memory(self, method: str) -> None:
        """``onload`` / ``offload`` on the policy and the critic ranks together."""
        self._call((self.graph.trainers, self.graph.critics), method)

    def _engines(self, method: str, **kwargs: Any) -> None:
        """Call an :class:`EngineClient` method on every synced engine. With fault tolerance a failing
        engine is reported and skipped (its server died: the sync below leaves it out, the rollout
        manager restarts it); otherwise the error propagates."""
        import ray

        handles = self.graph.engines.handles
        refs = {i: handles[i].call.remote(method, **kwargs) for i in self.graph.synced_engines}
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                if not self.recipe.use_fault_tolerance:
                    raise
                self.console.print(f"[yellow]engine {i}: {method} failed ({str(exc).splitlines()[0]})[/]")

    def resume(self) -> int:
        """Load the newest complete checkpoint of ``load`` (if any); returns the first rollout id to run."""
        import ray

        start = self.recipe.start_rollout_id or 0
        if not self.recipe.load:
            return start
        infos = self._trainers("load_checkpoint")
        info = infos[0]
        if info is None:
            self.console.print(f"[yellow]load={self.recipe.load!r}: no complete checkpoint there; starting at step "
                               f"{start}[/]")
            return start
        extra = info.get("extra") or {}
        if extra.get("data_state") is not None:
            ray.get(self.graph.manager.load_data_state.remote(extra["data_state"]))
        self._critics("load_checkpoint", None, int(info["rollout_id"]))
        self.version = int(info["start_rollout_id"])
        self.console.print(f"resumed from {info['path']} (saved after step {info['rollout_id']}); "
                           f"continuing at step {info['start_rollout_id']}", markup=False)
        # The engines still hold the initial weights: give them the checkpoint's.
        self.graph.weight_sync.push(self.version)
        return int(info["start_rollout_id"])

    def train_on(self, samples: list[Any], step: int, timer: PhaseTimer) -> dict[str, float]:
        import ray

        from raygym.algo.mismatch import batch_mismatch
        from raygym.trainer.actor import PackedBatch
        from raygym.trainer.batch import TrainBatch

        recipe = self.recipe
        if recipe.colocate:
            with timer.phase("offload"):
                self._engines("release_memory_occupation")
                self.events.append(f"{step}:engines.release")
                self._memory("onload")
                self.events.append(f"{step}:trainers.onload")
        batch = TrainBatch.from_samples(samples, group_size=recipe.n_samples_per_prompt)
        with timer.phase("log_probs"):
            # Old log-probs are redundant with one optimizer step per rollout (the trainer then uses its own
            # detached ones); PPO's critic values the old states for GAE. Both passes run at the same time.
            policy_ranks = self.graph.trainers.handles
            critic_ranks = self.graph.critics.handles if self.graph.critics is not None else []
            old_pass = [] if self.graph.single_pass_log_probs else policy_ranks
            if old_pass or critic_ranks:
                ref = ray.put(PackedBatch.pack(batch))  # one object for every rank, a few flat tensors
                log_probs = [h.compute_log_probs.remote(ref, step) for h in old_pass]
                values = [h.compute_values.remote(ref, step) for h in critic_ranks]
                if log_probs:
                    batch = batch.with_log_probs(ray.get(log_probs)[0])
                if values:
                    batch = batch.with_log_probs(ray.get(values)[0])
        mismatch = batch_mismatch(batch)  # engine vs trainer log-probs (single-pass trainers report their own)
        batch = batch.with_advantages(
            recipe.advantage_estimator, kl_coef=recipe.kl_coef, gamma=recipe.gamma, lambd=recipe.lambd
        )
        if recipe.distill_teacher_checkpoint:  # on-policy distillation (raygym/distill.py)
            from raygym.distill import distill_advantages

            batch = distill_advantages(batch, samples, kl_coef=recipe.distill_kl_coef,
                                       task_weight=recipe.distill_task_weight)
        with timer.phase("train"):
            ref = ray.put(PackedBatch.pack(batch))
            policy = [h.train_step.remote(ref, step) for h in policy_ranks]
            critic = [h.train_step.remote(ref, step) for h in critic_ranks]
            train_metrics = ray.get(policy)[0]  # the critic trains on its own ranks meanwhile
            critic_metrics = ray.get(critic)[0] if critic else {}
        self.events.append(f"{step}:train")
        return {**train_metrics, **critic_metrics, **_advantage_stats(batch), **mismatch}

    def save(self, step: int, data_state: dict[str, Any]) -> None:
        extra = {"data_state": data_state, "weight_version": self.version, "run_id": self.cfg.run_id}
        # The critic first: a step's policy manifest (what resume looks for) then implies its critic exists.
        self._critics("save_checkpoint", step, extra, self.cfg.checkpoint_dir)
        paths = self._trainers("save_checkpoint", step, extra, self.cfg.checkpoint_dir)
        self.checkpoints.append(paths[0])

    def _recover_engines(self) -> dict[str, float]:
        """Before a sync: if an engine was restarted (fault tolerance), wait for restarts in progress and
        rebuild the weight sync over every live engine, so the push below reaches the new servers."""
        import ray

        from raygym.graph import ENGINE_START_TIMEOUT_S

        manager = self.graph.manager
        states = ray.get(manager.engine_states.remote())
        live = [i for i, state in enumerate(states) if state != "dead"]
        if all(state == "healthy" for state in states) and live == self.graph.synced_engines:
            return {}
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while "dead" in states and time.monotonic() < deadline:  # restarting (or its restart failed)
            time.sleep(0.25)
            states = ray.get(manager.engine_states.remote())
        live = [i for i, state in enumerate(states) if state != "dead"]
        alive = ray.get([self.graph.engines.handles[i].alive.remote() for i in live])
        live = [i for i, ok in zip(live, alive, strict=True) if ok]  # a death the manager has not seen yet
        if not live:
            raise RaygymError(f"every rollout engine is dead and could not be restarted (states {states})")
        self.console.print(f"[yellow]engines restarted: re-forming the weight sync over engines {live}[/]")
        self.graph.make_weight_sync(live)
        self.engine_rebuilds += 1
        return {"sync/engine_rebuilds": float(self.engine_rebuilds)}

    def sync(self, version: int, step: int, timer: PhaseTimer) -> dict[str, float]:
        import ray

        colocate = self.recipe.colocate
        if colocate:  # weights back before the push, the KV cache after it (FIELD-NOTES: SGLang)
            with timer.phase("offload"):
                self._memory("offload")
                self.events.append(f"{step}:trainers.offload")
                self._engines("resume_memory_occupation", tags=["weights"])
                self.events.append(f"{step}:engines.resume_weights")
        with timer.phase("sync"):
            out = self._recover_engines() if self.recipe.use_fault_tolerance else {}
            out.update(self._push(version))
            self.version = version
            self.events.append(f"{step}:sync")
        if colocate:
            with timer.phase("offload"):
                self._engines("resume_memory_occupation", tags=["kv_cache"])
                self.events.append(f"{step}:engines.resume_kv_cache")
        with timer.phase("sync"):
            # Engines restarted by fault tolerance got the full push above: put them back in rotation.
            ray.get(self.graph.manager.set_weight_version.remote(version))
            needing = set(ray.get(self.graph.manager.engines_needing_weights.remote()))
            for i in sorted(needing & set(self.graph.synced_engines)):
                ray.get(self.graph.manager.mark_engine_synced.remote(i, version))
            out["sync/engines"] = float(len(self.graph.synced_engines))
        return out

    def _push(self, version: int) -> dict[str, float]:
        """``weight_sync.push``; with fault tolerance, an engine whose server died since the last rollout
        is left out (the rollout manager restarts it when its next request fails, and the next sync
        brings it back) instead of failing the run."""
        import ray

        try:
            return self.graph.weight_sync.push(version)
        except WeightSyncError:
            if not self.recipe.use_fault_tolerance:
                raise
            handles = self.graph.engines.handles
            alive = ray.get([handles[i].alive.remote() for i in self.graph.synced_engines])
            live = [i for i, ok in zip(self.graph.synced_engines, alive, strict=True) if ok]
            if not live or len(live) == len(self.graph.synced_engines):
                raise
            self.console.print(f"[yellow]weight sync failed on a dead engine: syncing engines {live}[/]")
            self.graph.make_weight_sync(live)
            self.engine_rebuilds += 1
            out = self.graph.weight_sync.push(version)
            out["sync/engine_rebuilds"] = float(self.engine_rebuilds)
            return out

    def evaluate(self, step: int, timer: PhaseTimer) -> dict[str, Any]:
        import ray

        with timer.phase("eval"):
            row = ray.get(self.graph.manager.evaluate.remote(step))
            spec = self.recipe.custom_eval_rollout_log_function
            if spec:
                samples = ray.get(self.graph.manager.eval_samples.remote())
                _call_log_hook(spec, "custom_eval_rollout_log_function", step, samples, row)
        return row

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
            rollout_metrics, data_state = ray.get([manager.metrics.remote(), manager.data_state.remote()])
            pending = None
            if recipe.async_mode and step < last:
                # Overlaps training below; generated on the weights of step `step` (one step stale).
                pending = manager.generate.remote(step + 1, self.version)
            row: dict[str, Any] = dict(rollout_metrics)
            # The manager's own generation time; perf/rollout_time below is what the driver waited.
            row["rollout/generate_time"] = row.pop("perf/rollout_time", 0.0)
            row["rollout/weight_version_min"] = min(s.weight_version for s in samples)
            row["rollout/weight_version_max"] = max(s.weight_version for s in samples)
            row["rollout/staleness_max"] = self.version - row["rollout/weight_version_min"]
            row.update(self.train_on(samples, step, timer))
            if recipe.async_mode and pending is not None:
                with timer.phase("rollout_wait"):
                    ray.wait([pending])  # the next rollout must finish on the old weights before the sync
            if _should(recipe.save_interval, step, last):
                with timer.phase("save"):
                    self.save(step, data_state)
            row.update(self.sync(step + 1, step, timer))
            if _eval_due(recipe.eval_interval, step):
                row.update(self.evaluate(step, timer))
            if not recipe.async_mode and step < last:
                pending = manager.generate.remote(step + 1, self.version)
            row.update(self._step_timing(timer, t0, samples))
            if recipe.capture_trace:
                write_traces(self.run_dir, step, samples)
            if recipe.custom_rollout_log_function:
                _call_log_hook(recipe.custom_rollout_log_function, "custom_rollout_log_function", step, samples, row)
            logged = self.metrics.log(step, apply_substep_timing(row, recipe.substep_timing))
            self.rows.append(logged)
            if self.progress is not None:
                self.progress.step(logged)
            else:
                self.console.print(progress_line(logged, recipe.num_rollout), soft_wrap=True)
            final = step
        return final

    @staticmethod
    def _step_timing(timer: PhaseTimer, t0: float, samples: list[Any]) -> dict[str, float]:
        """perf/<phase>_time per phase, perf/step_time, perf/other_time (control overhead: the step
        minus its timed phases) and perf/tokens_per_s (prompt + response tokens of the step)."""
        out: dict[str, float] = dict(timer.as_metrics())
        step_time = time.perf_counter() - t0
        out["perf/step_time"] = step_time
        for key in ("perf/rollout_time", "perf/train_time", "perf/sync_time"):
            out.setdefault(key, 0.0)
        out["perf/other_time"] = max(0.0, step_time - sum(timer.seconds.values()))
        tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
        out["perf/tokens_per_s"] = tokens / step_time if step_time > 0 else 0.0
        return out


def _advantage_stats(batch: Any) -> dict[str, float]:
    import torch

    if not batch.advantages:
        return {}
    flat = torch.cat([a.float() for a in batch.advantages]) if batch.advantages else torch.zeros(0)
    if flat.numel() == 0:
        return {}
    return {"train/adv_mean": flat.mean().item(), "train/adv_std": flat.std().item() if flat.numel() > 1 else 0.0,
            "train/adv_abs_max": flat.abs().max().item()}


@contextmanager
def _sigint_deferred(console: Any) -> Iterator[None]:
    """While tearing down, a second Ctrl-C must not leave server processes and placement groups
    behind: it is reported and ignored until the release is done (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        console.print("[yellow]still releasing actors and placement groups; one moment[/]")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def train(cfg: Any) -> TrainResult:
    """Run RL post-training as described by ``cfg`` (a :class:`raygym.TrainConfig`).

    Attaches to the Ray of this process, else joins ``RAY_ADDRESS`` (``ray job submit``), else starts
    a local one; builds the graph, runs steps ``start .. num_rollout-1``, exports the final weights as
    an HF model (``<run_dir>/hf``) when the run saves checkpoints, and always releases every actor and
    placement group it started — also on Ctrl-C (re-raised as ``KeyboardInterrupt``; a checkpoint
    being written is left without its manifest, so it never counts as complete) or an actor's death
    (re-raised as :class:`raygym.errors.RaygymError` naming the actor and the last complete checkpoint).

    Hooks: ``custom_rollout_log_function(rollout_id, samples, metrics_row)`` after each step (the
    step's ``list[Sample]``; ``metrics_row`` the dict about to be logged) and
    ``custom_eval_rollout_log_function(rollout_id, samples, metrics_row)`` after each eval (samples:
    ``{dataset name: list[Sample]}``; ``metrics_row`` the ``eval/*`` dict). Either may return a dict
    of extra metrics, merged into the row.
    """
    started = time.monotonic()
    from raygym.preflight import preflight

    console = _console()
    recipe = cfg.recipe
    apply_substep_timing({}, recipe.substep_timing)  # a bad value fails before any resource is taken
    facts = preflight(cfg)  # data, rewards, model path, writable directories: ConfigError before Ray
    import ray

    from raygym.builtin import resolve_model_path
    from raygym.graph import (
        build_graph,
        config_error_of,
        last_complete_checkpoint,
        preflight_engine,
        raise_actor_death,
    )

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model.hf_checkpoint, run_dir / "cache", seed=0)
    preflight_engine(recipe, model_path)  # the engine can run the model here and take the configured weight sync
    for line in _banner(cfg, facts):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_checkpoint": model_path})})
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json_dict(), indent=2, default=str) + "\n")

    auth = ExitStack()
    owns_ray = connect_ray(recipe.gpu_allocation().total_gpus + recipe.auxiliary_gpus(), auth)
    graph = None
    loop = None
    start = final = -1
    hf_path = None
    fast_release = True
    progress = None
    try:
        graph = build_graph(cfg, model_path, run_dir, say=console.print)
        loop = Loop(cfg, graph, console)
        start = loop.resume()
        with MetricsLogger(run_dir, cfg.metrics, run_id=cfg.run_id, config_dict=cfg.to_json_dict(),
                           resume_from_step=start if recipe.load else None) as metrics, \
                StepProgress(console, start, recipe.num_rollout) as progress:
            loop.progress = progress
            final = loop.run(start, metrics)
        if loop.checkpoints:
            hf_path = loop._trainers("export_hf", str(run_dir / "hf"))[0]
        fast_release = False
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
        user_error = config_error_of(exc)  # a ConfigError raised while an actor was created
        if user_error is not None:
            raise user_error from None
        raise_actor_death(exc, graph, last_complete_checkpoint(cfg.checkpoint_dir))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ConfigError):  # a user mistake found inside an actor: say it plainly
            raise exc.cause from None
        raise
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: releasing actors and placement groups[/]")
        raise
    finally:
        with _sigint_deferred(console):
            if graph is not None:
                graph.shutdown(fast=fast_release)
            if owns_ray:
                ray.shutdown()
            auth.close()

    history = loop.metrics.history if loop and loop.metrics else []
    task = f"{Path(cfg.dataset.prompt_data).name}, reward {' + '.join(f.name for f in facts.rewards)}"
    curve = plot_reward_curve(history, run_dir / "reward_curve.png", title=f"raygym run {cfg.run_id} | {task}")
    if history:
        console.print(summary_table(history, title=f"raygym run {cfg.run_id}"))
        console.print(loss_note(recipe.advantage_estimator), markup=False, highlight=False, soft_wrap=True)
    if curve:
        console.print(f"reward curve: {curve}", markup=False, highlight=False, soft_wrap=True)
    if progress is not None:
        console.print(progress.final_line(start, final, str(run_dir), time.monotonic() - started),
                      markup=False, highlight=False, soft_wrap=True)
    return TrainResult(
        run_dir=str(run_dir),
        metrics_path=str(run_dir / "metrics.jsonl"),
        final_step=final,
        checkpoint_paths=list(loop.checkpoints) if loop else [],
        hf_export_path=hf_path,
        reward_curve_path=curve,
        steps=list(loop.rows) if loop else [],
        events=list(loop.events) if loop else [],
    )


__all__ = ["TrainResult", "train", "RaygymError"]
