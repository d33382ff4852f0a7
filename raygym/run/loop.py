"""The training loop over a built :class:`raygym.run.graph.RunGraph`, written as the algorithm reads.

Per step: rollout -> [colocate: engines release memory, trainers onload] -> log-probs -> advantages ->
train -> save every ``save_interval`` -> [colocate: trainers offload, engines resume their weights] ->
weight sync (verified on every engine) -> [colocate: engines resume the KV cache] -> eval every
``eval_interval`` -> metrics row, hooks, progress -> the save committed. A checkpoint is written before the
sync (trainers still hold their state on device) but counts only once the step's rows are on disk, so a
resumed run lists every step exactly once, wherever a kill lands. When the next rollout starts is the schedule's
business (:class:`SyncSchedule`: after the sync; :class:`AsyncSchedule`: before training, one step
off-policy); the memory moves of a colocated run are :class:`Colocation`'s.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from raygym.config import Recipe, TrainConfig
from raygym.config.schedule import FullyAsync, OneStepOff, Sync
from raygym.engine_api.protocol import Endpoint
from raygym.rollout.stream import staleness_metrics
from raygym.run.metrics import MetricsLogger, PhaseTimer, apply_substep_timing, progress_line, write_traces

if TYPE_CHECKING:
    from raygym.cluster.actor_group import RemoteCall
    from raygym.run.graph import RunGraph


def _should(interval: int | None, step: int, last_step: int) -> bool:
    if not interval:
        return False
    return ((step + 1) % interval == 0 or step == last_step)


def _eval_due(interval: int | None, step: int) -> bool:
    """Eval after the sync of every ``eval_interval``-th step (a property of the step, not of the run's
    length, so a resumed run evaluates at the same steps as an uninterrupted one)."""
    if not interval:
        return False
    return (step + 1) % interval == 0


def _call_log_hook(spec: Any, field_name: str, step: int, samples: Any, row: dict[str, Any]) -> None:
    """Call a ``custom_*_log_function`` as ``fn(rollout_id, samples, metrics_row)``; a returned mapping
    is merged into the row (extra metrics to log)."""
    from raygym.callables import load_callable

    hook = load_callable(spec, field_name)
    assert hook is not None
    extra = hook(step, samples, row)
    if isinstance(extra, dict):
        row.update(extra)


def _commit_on(rank: Any, url: str) -> Any:
    return rank.commit_checkpoint.remote(url)


def call_ranks(groups: tuple[Any, ...], call: RemoteCall) -> list[Any]:
    """``call`` (``lambda rank: rank.offload.remote()``) on every rank of ``groups`` (ActorGroups; None = absent)
    at once, results in order."""
    import ray

    return ray.get([call(h) for g in groups if g is not None for h in g.handles])


@dataclass(frozen=True)
class PendingCheckpoint:
    """A step's checkpoint written by :meth:`Loop.save` and not yet committed (its manifest still pending)."""

    policy_url: str
    critic_url: str | None = None


class Colocation:
    """The memory moves of a colocated run, in their one valid order, recorded in ``events`` as
    ``"<step>:<what>"``: before training, engines release memory then trainers onload; before the sync,
    trainers offload then engines resume their weights; after the sync, engines resume the KV cache
    (weights must be back before the push, the cache only after it). Disaggregated: nothing moves."""

    def __init__(self, enabled: bool, graph: RunGraph, events: list[str]) -> None:
        self.enabled = enabled
        self.graph = graph
        self.events = events

    def before_train(self, step: int, timer: PhaseTimer) -> None:
        if self.enabled:
            with timer.phase("offload"):
                self.graph.fleet.call(Endpoint.RELEASE_MEMORY)
                self.events.append(f"{step}:engines.release")
                call_ranks((self.graph.trainers, self.graph.critics), lambda rank: rank.onload.remote())
                self.events.append(f"{step}:trainers.onload")

    def before_sync(self, step: int, timer: PhaseTimer) -> None:
        if self.enabled:
            with timer.phase("offload"):
                call_ranks((self.graph.trainers, self.graph.critics), lambda rank: rank.offload.remote())
                self.events.append(f"{step}:trainers.offload")
                self.graph.fleet.call(Endpoint.RESUME_MEMORY, tags=["weights"])
                self.events.append(f"{step}:engines.resume_weights")

    def after_sync(self, step: int, timer: PhaseTimer) -> None:
        if self.enabled:
            with timer.phase("offload"):
                self.graph.fleet.call(Endpoint.RESUME_MEMORY, tags=["kv_cache"])
                self.events.append(f"{step}:engines.resume_kv_cache")


class SyncSchedule:
    """The rollout of step k+1 starts once step k's weights are on the engines (on-policy)."""

    def __init__(self, manager: Any, last: int) -> None:
        self.manager, self.last = manager, last

    def first(self, start: int, version: int) -> Any:
        return self.manager.generate.remote(start, version) if start <= self.last else None

    def after_rollout(self, step: int, version: int) -> Any:
        return None

    def before_sync(self, pending: Any, timer: PhaseTimer) -> None:
        """Nothing is generating during the sync."""

    def after_sync(self, step: int, version: int, pending: Any) -> Any:
        return self.manager.generate.remote(step + 1, version) if step < self.last else None

    def close(self) -> None:
        """The run ends (or fails): nothing to stop."""


class AsyncSchedule(SyncSchedule):
    """The rollout of step k+1 runs while step k trains, on the weights before step k's update (one step
    off-policy; every sample carries the version that generated it)."""

    def after_rollout(self, step: int, version: int) -> Any:
        return self.manager.generate.remote(step + 1, version) if step < self.last else None

    def before_sync(self, pending: Any, timer: PhaseTimer) -> None:
        import ray

        if pending is not None:
            with timer.phase("rollout_wait"):
                ray.wait([pending])  # the next rollout must finish on the old weights before they change

    def after_sync(self, step: int, version: int, pending: Any) -> Any:
        return pending


class FullyAsyncSchedule(SyncSchedule):
    """Engines generate continuously (the rollout manager's stream, at most ``max_staleness`` steps ahead);
    each step takes the groups that completed, fresh enough for it, and the next step's take is asked for at
    once, so it waits on generation only when the engines are behind. Weight updates land while requests
    are in flight."""

    def __init__(self, manager: Any, last: int, schedule: FullyAsync) -> None:
        super().__init__(manager, last)
        self.max_staleness, self.policy = schedule.max_staleness, schedule.stale_sample_policy

    def first(self, start: int, version: int) -> Any:
        import ray

        if start > self.last:
            return None
        ray.get(self.manager.start_stream.remote(start, version, self.max_staleness, self.policy))
        return self.manager.take.remote(start)

    def after_rollout(self, step: int, version: int) -> Any:
        return self.manager.take.remote(step + 1) if step < self.last else None

    def after_sync(self, step: int, version: int, pending: Any) -> Any:
        return pending

    def close(self) -> None:
        import ray

        ray.get(self.manager.stop_stream.remote())


def schedule_for(recipe: Recipe, manager: Any, last: int) -> SyncSchedule:
    """The loop's side of ``recipe.schedule``: fully asynchronous, one step off-policy, or synchronous."""
    match recipe.schedule:
        case FullyAsync() as fully_async:
            return FullyAsyncSchedule(manager, last, fully_async)
        case OneStepOff():
            return AsyncSchedule(manager, last)
        case Sync():
            return SyncSchedule(manager, last)


class Loop:
    """One run's loop. ``events`` (see :class:`Colocation`) and ``rows`` (one metrics row per step) are kept
    for the caller; ``checkpoints`` lists the checkpoints written."""

    def __init__(self, cfg: TrainConfig, graph: RunGraph, console: Any) -> None:
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
        self.colocation = Colocation(self.recipe.colocate, graph, self.events)
        self.progress: Any = None  # raygym.run.display.StepProgress; None prints plain step lines

    def trainers(self, call: RemoteCall) -> list[Any]:
        """``call`` on every policy trainer rank, results in rank order."""
        return call_ranks((self.graph.trainers,), call)

    def critics(self, call: RemoteCall) -> list[Any]:
        """``call`` on every critic rank (PPO); ``[]`` when the run has no critic."""
        return call_ranks((self.graph.critics,), call)

    def resume(self) -> int:
        """Load the newest complete checkpoint of ``load`` (if any); returns the first rollout id to run."""
        import ray

        start = self.recipe.start_rollout_id or 0
        if not self.recipe.load:
            return start
        info = self.trainers(lambda trainer: trainer.load_checkpoint.remote())[0]
        if info is None:
            self.console.print(f"[yellow]load={self.recipe.load!r}: no complete checkpoint there; starting at step "
                               f"{start}[/]")
            return start
        extra = info.get("extra") or {}
        if extra.get("data_state") is not None:
            ray.get(self.graph.manager.load_data_state.remote(extra["data_state"]))
        self.critics(lambda critic: critic.load_checkpoint.remote(None, int(info["rollout_id"])))
        self.version = int(info["start_rollout_id"])
        self.console.print(f"resumed from {info['path']} (saved after step {info['rollout_id']}); "
                           f"continuing at step {info['start_rollout_id']}", markup=False)
        self.graph.fleet.push(self.version)  # the engines still hold the initial weights
        return int(info["start_rollout_id"])

    def train_on(self, samples: list[Any], step: int, timer: PhaseTimer) -> dict[str, float]:
        """Old log-probs (and PPO's values), advantages and the optimizer steps of one rollout."""
        import ray

        from raygym.trainer.actor import PackedBatch
        from raygym.trainer.batch import TrainBatch, batch_mismatch

        recipe = self.recipe
        self.colocation.before_train(step, timer)
        batch = TrainBatch.from_samples(samples, group_size=recipe.n_samples_per_prompt)
        if isinstance(schedule := recipe.schedule, FullyAsync):  # the mismatch is split by each token's age
            batch = batch.with_token_ages([[self.version - v for v in (s.token_versions or
                                                                       [s.weight_version] * s.response_length)]
                                           for s in samples], schedule.max_staleness + 1)
        policy_ranks = self.graph.trainers.handles
        critic_ranks = self.graph.critics.handles if self.graph.critics is not None else []
        with timer.phase("log_probs"):
            # Old log-probs are redundant with one optimizer step per rollout (the trainer then uses its own
            # detached ones); PPO's critic values the old states for GAE. Both passes run at the same time.
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
        batch = batch.with_advantages(recipe.advantage_estimator, kl_coef=recipe.kl_coef, gamma=recipe.gamma,
                                      lambd=recipe.lambd)
        if recipe.distill_teacher_checkpoint:  # on-policy distillation (raygym/rewards/distill.py)
            from raygym.rewards.distill import distill_advantages

            batch = distill_advantages(batch, samples, kl_coef=recipe.distill_kl_coef,
                                       task_weight=recipe.distill_task_weight)
        with timer.phase("train"):
            ref = ray.put(PackedBatch.pack(batch))
            policy = [h.train_step.remote(ref, step) for h in policy_ranks]
            critic = [h.train_step.remote(ref, step) for h in critic_ranks]
            train_metrics = ray.get(policy)[0]  # the critic trains on its own ranks meanwhile
            critic_metrics = ray.get(critic)[0] if critic else {}
        self.events.append(f"{step}:train")
        return {**train_metrics, **critic_metrics, **mismatch}

    def save(self, step: int, data_state: dict[str, Any]) -> PendingCheckpoint:
        """Write step ``step``'s checkpoint (policy and critic), not yet complete: :meth:`commit` completes it
        once the step's rows are on disk."""
        extra = {"data_state": data_state, "weight_version": self.version, "run_id": self.cfg.run_id}
        save_dir = self.cfg.checkpoint_dir
        critic = self.critics(lambda rank: rank.save_checkpoint.remote(step, extra, save_dir, False))
        policy = self.trainers(lambda rank: rank.save_checkpoint.remote(step, extra, save_dir, False))[0]
        return PendingCheckpoint(policy_url=policy, critic_url=critic[0] if critic else None)

    def commit(self, pending: PendingCheckpoint) -> None:
        """Complete a saved checkpoint after its step's rows are durable: a kill anywhere leaves the step's
        rows and its checkpoint together (resume continues after it) or neither (resume redoes the step)."""
        from raygym.checkpoint.files import commit_manifest

        assert self.metrics is not None
        self.metrics.make_durable()
        # the critic first: a policy manifest then implies its critic's. The driver commits what it can reach
        # (the files are complete whatever became of the trainers since); a directory only the trainers' nodes
        # see is committed by their rank 0.
        for url, role in ((pending.critic_url, self.critics), (pending.policy_url, self.trainers)):
            if url is None:
                continue
            try:
                done = commit_manifest(url)
            except Exception:  # the store refuses the driver (its credentials, its filesystem): the trainers try
                done = False
            if not done:
                role(functools.partial(_commit_on, url=url))
        self.checkpoints.append(pending.policy_url)

    def sync(self, version: int, step: int, timer: PhaseTimer) -> dict[str, float]:
        """Every engine serves ``version`` (memory moves around the push when colocated)."""
        self.colocation.before_sync(step, timer)
        with timer.phase("sync"):
            out = self.graph.fleet.push(version)
            self.version = version
            self.events.append(f"{step}:sync")
        self.colocation.after_sync(step, timer)
        with timer.phase("sync"):
            out.update(self.graph.fleet.publish(version))
        return out

    def evaluate(self, step: int, timer: PhaseTimer) -> dict[str, Any]:
        import ray

        with timer.phase("eval"):
            # an async actor method: ray's types do not see through its coroutine
            row = cast(dict[str, Any], ray.get(self.graph.manager.evaluate.remote(step)))
            spec = self.recipe.custom_eval_rollout_log_function
            if spec:
                samples = ray.get(self.graph.manager.eval_samples.remote())
                _call_log_hook(spec, "custom_eval_rollout_log_function", step, samples, row)
        return row

    def run(self, start: int, metrics: MetricsLogger, stop_after: int | None = None) -> int:
        """Run steps ``start .. num_rollout-1``; returns the last completed step. ``stop_after``: end after that
        step instead, with a checkpoint of it (``auto_split`` goes on from there with another split)."""
        import ray

        self.metrics = metrics
        recipe = self.recipe
        last = recipe.num_rollout - 1 if stop_after is None else min(stop_after, recipe.num_rollout - 1)
        manager = self.graph.manager
        schedule = schedule_for(recipe, manager, last)
        final = start - 1
        try:
            pending = schedule.first(start, self.version)
            for step in range(start, last + 1):
                timer, t0 = PhaseTimer(), time.perf_counter()
                with timer.phase("rollout"):
                    samples = ray.get(pending)
                rollout_metrics: dict[str, float]
                data_state: dict[str, Any]
                rollout_metrics, data_state = ray.get([manager.metrics.remote(), manager.data_state.remote()])
                pending = schedule.after_rollout(step, self.version)
                row = self._rollout_row(rollout_metrics, samples)
                if step == start:  # what loading the data left out (data/*), in the first row after it loaded
                    data_metrics: dict[str, float] = ray.get(manager.data_metrics.remote())
                    row.update(data_metrics)
                row.update(self.train_on(samples, step, timer))
                schedule.before_sync(pending, timer)
                saved = None
                if _should(recipe.save_interval, step, last) or step == stop_after:
                    with timer.phase("save"):
                        saved = self.save(step, data_state)
                row.update(self.sync(step + 1, step, timer))
                if _eval_due(recipe.eval_interval, step):
                    row.update(self.evaluate(step, timer))
                pending = schedule.after_sync(step, self.version, pending)
                row.update(self._step_timing(timer, t0, samples))
                self._log(step, samples, row)
                if saved is not None:
                    self.commit(saved)
                final = step
        finally:
            schedule.close()
        return final

    def _rollout_row(self, rollout_metrics: dict[str, Any], samples: list[Any]) -> dict[str, Any]:
        row: dict[str, Any] = dict(rollout_metrics)
        # The manager's own generation time; perf/rollout_time is what the driver waited.
        row["rollout/generate_time"] = row.pop("perf/rollout_time", 0.0)
        row["rollout/weight_version_min"] = min(s.weight_version for s in samples)
        row["rollout/weight_version_max"] = max(s.max_version for s in samples)
        schedule = self.recipe.schedule
        row.update(staleness_metrics(samples, self.version,
                                     schedule.max_staleness if isinstance(schedule, FullyAsync) else 1))
        return row

    def _log(self, step: int, samples: list[Any], row: dict[str, Any]) -> None:
        recipe = self.recipe
        if recipe.capture_trace:
            write_traces(self.run_dir, step, samples)
        if recipe.custom_rollout_log_function:
            _call_log_hook(recipe.custom_rollout_log_function, "custom_rollout_log_function", step, samples, row)
        assert self.metrics is not None
        logged = self.metrics.log(step, apply_substep_timing(row, recipe.substep_timing))
        groups = [s for s in samples if s.sample_index == 0]
        self.metrics.log_prompts(step, [s.data_index for s in groups], [s.prompt_key for s in groups])
        self.rows.append(logged)
        if self.progress is not None:
            self.progress.step(logged)
        else:
            self.console.print(progress_line(logged, recipe.num_rollout), soft_wrap=True)

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
