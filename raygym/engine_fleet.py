"""The run's rollout engines as one thing the driver owns: which engines are live, which the weight sync
reaches, which weight version each holds; memory release/resume on all of them; recovery after a restart.

The rollout manager's :class:`raygym.rollout.health.EnginePool` is the data-plane half: it notices an engine
failing a request, restarts it in the background (so generation goes on elsewhere) and keeps it out of
rotation until it holds the current weights. Everything after that is here: before each sync the fleet
waits for restarts in progress, re-forms the weight-update group over the live engines (a restarted
server listens on a new port and must join again; its first push is full), pushes, and tells the manager
which engines now hold the version.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raygym.config import Recipe
from raygym.errors import RaygymError, WeightSyncError

ENGINE_START_TIMEOUT_S = 600.0


class EngineFleet:
    """Driver-side owner of the engine group's lifecycle and weight sync.

    ``engines``: the ActorGroup of :class:`raygym.rollout.engine.EngineActor`; ``trainers``: the policy's
    ActorGroup (rank 0 sends weights); ``manager``: the RolloutManager handle (it routes requests and
    restarts failed engines).
    """

    def __init__(self, recipe: Recipe, engines: Any, trainers: Any, manager: Any, *,
                 engine_dtype: str | None = None, say: Callable[[str], Any] = print,
                 adapter: tuple[dict[str, Any], str] | None = None) -> None:
        self.recipe = recipe
        self.engines = engines
        self.trainers = trainers
        self.manager = manager
        self.engine_dtype = engine_dtype  # the checkpoint's floating dtype: what SGLang serves
        self.say = say
        self.adapter = adapter  # LoRA: (the adapters' PEFT config, where adapter versions are written)
        self.weight_sync: Any = None  # raygym.weightsync.coordinator.WeightSync over `synced`
        self.synced: list[int] = []  # engine indexes the weight sync reaches
        self.urls: list[str] = []
        self.rebuilds = 0  # weight-sync rebuilds after engine restarts

    # ---- weight sync ------------------------------------------------------------------------------
    def connect(self, indexes: list[int]) -> None:
        """A connected weight sync from the trainers to engines ``indexes`` at their current URLs (its
        first push is full)."""
        import ray

        from raygym.rollout.capabilities import weight_update_session
        from raygym.weightsync.coordinator import WeightSync

        learned = None  # what update_weight_mode="auto" measured so far carries over to the new group
        if self.weight_sync is not None:
            learned = self.weight_sync.cost_model
            self.weight_sync.shutdown()  # the trainer leaves the old group; live engines destroy theirs
            self.weight_sync = None
        self.urls = ray.get([h.url.remote() for h in self.engines.handles])
        info = ray.get(self.engines.handles[indexes[0]].engine_info.remote())
        overrides: dict[str, Any] = {}
        if info["kind"] in ("sglang", "vllm"):  # send what the engine holds: its dtype, not fp32 masters
            overrides["cast_dtype"] = info.get("dtype") or self.engine_dtype
        if self.adapter is not None:  # LoRA: the adapters only (raygym.weightsync.adapter for adapter endpoints)
            from raygym.rollout.capabilities import capabilities

            overrides["adapter_config"] = self.adapter[0]
            if capabilities(info["kind"]).lora == "lora_endpoints":
                overrides["disk_dir"] = self.adapter[1]
        sync = WeightSync(self.recipe, self.trainers.handles, [self.urls[i] for i in indexes],
                          engine_kind=info["kind"], session=weight_update_session(info["kind"], info["version"]),
                          spec_overrides=overrides, cost_model=learned)
        sync.setup()
        self.weight_sync, self.synced = sync, list(indexes)

    def push(self, version: int) -> dict[str, float]:
        """Make every reachable engine serve ``version``. With fault tolerance, engines restarted since the
        last sync are brought in first, and an engine whose server died mid-push is left out (the manager
        restarts it on its next failed request; the next sync brings it back) instead of failing the run."""
        out = self.recover() if self.recipe.use_fault_tolerance else {}
        try:
            out.update(self.weight_sync.push(version))
        except WeightSyncError:
            live = self._alive(self.synced) if self.recipe.use_fault_tolerance else self.synced
            if not live or len(live) == len(self.synced):
                raise
            self.say(f"[yellow]weight sync failed on a dead engine: syncing engines {live}[/]")
            self._rebuild(live)
            out.update(self.weight_sync.push(version))
            out["sync/engine_rebuilds"] = float(self.rebuilds)
        return out

    def publish(self, version: int) -> dict[str, float]:
        """Tell the manager the engines hold ``version``; restarted engines that got it return to rotation."""
        import ray

        ray.get(self.manager.set_weight_version.remote(version))
        needing = set(ray.get(self.manager.engines_needing_weights.remote()))
        for i in sorted(needing & set(self.synced)):
            ray.get(self.manager.mark_engine_synced.remote(i, version))
        return {"sync/engines": float(len(self.synced))}

    def recover(self) -> dict[str, float]:
        """Wait for restarts in progress and re-form the weight sync when the live engines changed."""
        import ray

        states = ray.get(self.manager.engine_states.remote())
        live = [i for i, state in enumerate(states) if state != "dead"]
        if all(state == "healthy" for state in states) and live == self.synced:
            return {}
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while "dead" in states and time.monotonic() < deadline:  # restarting (or its restart failed)
            time.sleep(0.25)  # polls the manager's state of each engine until its restart ends
            states = ray.get(self.manager.engine_states.remote())
        live = self._alive([i for i, state in enumerate(states) if state != "dead"])
        if not live:
            raise RaygymError(f"every rollout engine is dead and could not be restarted (states {states})")
        self.say(f"[yellow]engines restarted: re-forming the weight sync over engines {live}[/]")
        self._rebuild(live)
        return {"sync/engine_rebuilds": float(self.rebuilds)}

    def _rebuild(self, live: list[int]) -> None:
        self.connect(live)
        self.rebuilds += 1

    def _alive(self, indexes: list[int]) -> list[int]:
        """Those of ``indexes`` whose server process lives (a death the manager has not seen yet)."""
        import ray

        alive = ray.get([self.engines.handles[i].alive.remote() for i in indexes])
        return [i for i, ok in zip(indexes, alive, strict=True) if ok]

    # ---- memory -----------------------------------------------------------------------------------
    def call(self, method: str, **kwargs: Any) -> None:
        """An :class:`EngineClient` method on every synced engine. With fault tolerance a failing engine is
        reported and skipped (its server died: the next sync leaves it out, the manager restarts it);
        otherwise the error propagates."""
        import ray

        handles = self.engines.handles
        refs = {i: handles[i].call.remote(method, **kwargs) for i in self.synced}
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                if not self.recipe.use_fault_tolerance:
                    raise
                self.say(f"[yellow]engine {i}: {method} failed ({str(exc).splitlines()[0]})[/]")

    def shutdown(self, fast: bool = False) -> None:
        """Leave the weight-update group (skipped when ``fast``: a busy or dead trainer would stall it)."""
        if self.weight_sync is not None and not fast:
            self.weight_sync.shutdown()
        self.weight_sync = None
