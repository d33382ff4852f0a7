"""The run's rollout engines as one thing the driver owns: which engines are live, which the weight sync
reaches, which weight version each holds; memory release/resume on all of them; recovery after a restart,
and replacement of an engine whose actor is gone (its node died).

The rollout manager's :class:`raygym.engines.health.EnginePool` is the data-plane half: it notices an engine
failing a request, restarts it in the background (so generation goes on elsewhere) and keeps it out of
rotation until it holds the current weights. Everything after that is here: before each sync the fleet
waits for restarts in progress, re-forms the weight-update group over the live engines (a restarted
server listens on a new port and must join again; its first push is full), pushes, and tells the manager
which engines now hold the version and which missed it. An engine the push did not reach (its server died
or its actor stopped answering between the rollout and the sync) gets no requests from then on: the manager
routes only to engines that hold the current version. The next sync that reaches it returns it to rotation;
one whose server is found dead is restarted first.

An engine whose actor died with its node is "lost": the run goes on without it. Before each sync the
fleet asks whether Ray has placed its bundles again (the node came back, or another with the resources
joined); then an :class:`raygym.engines.spawn.EngineSpawner` starts a new actor there, in the background.
Once its server answers, the manager takes the new actor (still without traffic), the weight sync is
re-formed over it and pushes the current weights, verified, and only then does it get requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raygym.config import Recipe
from raygym.errors import RaygymError, WeightSyncError

if TYPE_CHECKING:
    from raygym.engines.spawn import EngineSpawner
    from raygym.weightsync.probe import ImageProbe

ENGINE_START_TIMEOUT_S = 600.0
ALIVE_TIMEOUT_S = 30.0  # an engine actor that does not answer alive() in this time is left out of a sync


class EngineFleet:
    """Driver-side owner of the engine group's lifecycle and weight sync.

    ``engines``: the ActorGroup of :class:`raygym.engines.actor.EngineActor` (a replaced engine's new handle
    is written into it); ``trainers``: the policy's ActorGroup (rank 0 sends weights); ``manager``: the
    RolloutManager handle (it routes requests and restarts failed engines); ``spawner``: starts a new actor
    for an engine whose actor is gone (None: a lost engine stays lost).
    """

    def __init__(self, recipe: Recipe, engines: Any, trainers: Any, manager: Any, *,
                 engine_dtype: str | None = None, say: Callable[[str], Any] = print,
                 adapter: tuple[dict[str, Any], str] | None = None, spawner: EngineSpawner | None = None,
                 image_probe: ImageProbe | None = None) -> None:
        self.recipe = recipe
        self.engines = engines
        self.trainers = trainers
        self.manager = manager
        # the checkpoint's floating dtype: what the payload is cast to when the engine does not report its own
        # (stock SGLang's 'auto' serves a float32 checkpoint in float16, and converts a float32 payload on load)
        self.engine_dtype = engine_dtype
        self.say = say
        self.adapter = adapter  # LoRA: (the adapters' PEFT config, where adapter versions are written)
        self.image_probe = image_probe  # a vision-language model's image item of the sync probe
        self.weight_sync: Any = None  # raygym.weightsync.coordinator.WeightSync over `synced`
        self.synced: list[int] = []  # engine indexes the weight sync reaches
        self.urls: list[str] = []
        self.rebuilds = 0  # weight-sync rebuilds after engine restarts
        self.spawner = spawner
        self.replaced = 0  # engines whose lost actor was replaced by a new one
        self._starting: dict[int, tuple[Any, Any]] = {}  # engine -> (new actor, ObjectRef of its start())

    # ---- weight sync ------------------------------------------------------------------------------
    def connect(self, indexes: list[int]) -> None:
        """A connected weight sync from the trainers to engines ``indexes`` at their current URLs (its
        first push is full)."""
        import ray

        from raygym.engine_api.kinds import weight_update_session
        from raygym.weightsync.coordinator import WeightSync

        learned = None  # what update_weight_mode="auto" measured so far carries over to the new group
        if self.weight_sync is not None:
            learned = self.weight_sync.cost_model
            self.weight_sync.shutdown()  # the trainer leaves the old group; live engines destroy theirs
            self.weight_sync = None
        urls = ray.get([self.engines.handles[i].url.remote() for i in indexes])
        self.urls = [""] * len(self.engines.handles)
        for i, url in zip(indexes, urls, strict=True):
            self.urls[i] = url
        info = ray.get(self.engines.handles[indexes[0]].engine_info.remote())
        overrides: dict[str, Any] = {}
        if info["kind"] in ("sglang", "vllm"):  # send what the engine holds: its dtype, not fp32 masters
            overrides["cast_dtype"] = info.get("dtype") or self.engine_dtype
        if self.adapter is not None:  # LoRA: the adapters only (raygym.weightsync.adapter for adapter endpoints)
            from raygym.engine_api.kinds import capabilities

            overrides["adapter_config"] = self.adapter[0]
            if capabilities(info["kind"]).lora == "lora_endpoints":
                overrides["disk_dir"] = self.adapter[1]
        sync = WeightSync(self.recipe, self.trainers.handles, [self.urls[i] for i in indexes],
                          engine_kind=info["kind"], session=weight_update_session(info["kind"], info["version"]),
                          spec_overrides=overrides, cost_model=learned, image_probe=self.image_probe)
        sync.setup()
        self.weight_sync, self.synced = sync, list(indexes)

    def push(self, version: int) -> dict[str, float]:
        """Make every reachable engine serve ``version``. With fault tolerance, engines restarted since the
        last sync are brought in first, and an engine whose server died mid-push (or whose actor does not
        answer) is left out instead of failing the run: it leaves the manager's rotation at once, a dead server
        is restarted, and the next sync that reaches it brings it back."""
        out = self.recover() if self.recipe.use_fault_tolerance else {}
        try:
            out.update(self.weight_sync.push(version))
        except WeightSyncError:
            if not self.recipe.use_fault_tolerance:
                raise
            live = self._alive(self.synced)
            moved = self._moved(live)  # restarted while the sync ran (the manager's health check): a new address
            if not live or (len(live) == len(self.synced) and not moved):
                raise
            if moved:  # the manager's restart may still be starting it: wait for it, then re-form over the live
                self.say(f"[yellow]engines {moved} restarted during the weight sync: re-forming it[/]")
                out.update(self.recover())
            else:
                self.say(f"[yellow]weight sync failed on a dead engine: syncing engines {live}[/]")
                self._rebuild(live)
            out.update(self.weight_sync.push(version))
            out["sync/engine_rebuilds"] = float(self.rebuilds)
        self._hold_back_missed()
        return out

    def _hold_back_missed(self) -> None:
        """Engines outside the sync that just pushed leave rotation now, before :meth:`publish` (a caller may
        start the next rollout without publishing: a resumed run's first push)."""
        import ray

        missed = [i for i in range(len(self.engines.handles)) if i not in self.synced]
        if missed:
            ray.get(self.manager.hold_back.remote(missed))

    def publish(self, version: int) -> dict[str, float]:
        """Tell the manager that the engines of the sync that just succeeded (``synced``) hold ``version``:
        they serve it (restarted ones return to rotation); every other engine gets no requests until a sync
        reaches it."""
        import ray

        left = ray.get(self.manager.apply_sync.remote(version, list(self.synced)))
        if left:
            self.say(f"[yellow]engines {left} missed the sync to version {version}: no requests until a sync "
                     "reaches them[/]")
        return {"sync/engines": float(len(self.synced)), "sync/engines_replaced": float(self.replaced)}

    def recover(self) -> dict[str, float]:
        """Replace lost engines whose bundles are placed again, wait for restarts in progress and re-form the
        weight sync when the live engines changed."""
        import ray

        self._replace_lost(ray.get(self.manager.engine_states.remote()))
        states = ray.get(self.manager.engine_states.remote())
        live = [i for i, state in enumerate(states) if state not in ("dead", "lost")]
        if all(state in ("healthy", "lost") for state in states) and live == self.synced:
            return {}
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while "dead" in states and time.monotonic() < deadline:  # restarting (or its restart failed)
            time.sleep(0.25)  # polls the manager's state of each engine until its restart ends
            states = ray.get(self.manager.engine_states.remote())
        live = self._alive([i for i, state in enumerate(states) if state not in ("dead", "lost")])
        if not live:
            raise RaygymError(f"every rollout engine is dead and could not be restarted (states {states})")
        if live == self.synced and all(states[i] == "healthy" for i in live):
            return {}  # only engines that missed a sync and still do not answer are out: nothing to re-form
        if live != self.synced:
            self.say(f"[yellow]engines changed: re-forming the weight sync over engines {live}[/]")
        self._rebuild(live)
        return {"sync/engine_rebuilds": float(self.rebuilds)}

    def _replace_lost(self, states: list[str]) -> None:
        """Start a new actor for each lost engine whose bundles Ray placed again (in the background), and hand
        the ones whose server is up to the manager: they then wait for weights like a restarted engine."""
        import ray

        if self.spawner is None:
            return
        for i, state in enumerate(states):
            if state != "lost":
                continue
            if i not in self._starting:
                bundles = self.spawner.placed(i)
                if bundles is None:  # its node (or one that can take its bundles) has not joined yet
                    continue
                self.say(f"[yellow]engine {i}: its GPUs are placed again on {bundles[0].node_ip}; starting a new "
                         "engine there[/]")
                self._starting[i] = self.spawner.spawn(i, bundles, old=self.engines.handles[i])
            handle, started = self._starting[i]
            if not ray.wait([started], timeout=0)[0]:
                continue  # still starting: the run goes on without it
            del self._starting[i]
            try:
                ray.get(started)
            except Exception as exc:  # its node died again, or the server did not come up: try again later
                self.say(f"[yellow]engine {i}: the new engine failed to start ({str(exc).splitlines()[0]})[/]")
                try:
                    ray.kill(handle, no_restart=True)  # frees its bundle for the next try
                except Exception:  # already gone
                    pass
                continue
            self.engines.handles[i] = handle
            ray.get(self.manager.replace_engine.remote(i, handle))
            self.replaced += 1
            self.say(f"[yellow]engine {i}: replaced; it gets requests once it holds the current weights[/]")

    def _rebuild(self, live: list[int]) -> None:
        self.connect(live)
        self.rebuilds += 1

    def _moved(self, indexes: list[int]) -> list[int]:
        """Those of ``indexes`` whose server is no longer at the address the weight sync was formed with."""
        import ray

        refs = {i: self.engines.handles[i].url.remote() for i in indexes}  # asked at once
        moved = []
        for i, ref in refs.items():
            try:
                url = ray.get(ref, timeout=ALIVE_TIMEOUT_S)
            except (ray.exceptions.RayError, RaygymError):  # mid-restart: no address yet
                url = ""
            if url != self.urls[i]:
                moved.append(i)
        return moved

    def _alive(self, indexes: list[int]) -> list[int]:
        """Those of ``indexes`` whose server process lives (a death the manager has not seen yet). An engine
        whose actor is gone (its node died) is reported to the manager as lost, one whose server died as failed
        (the manager restarts it: it gets no requests that would show it)."""
        import ray

        from raygym.engines.health import actor_gone

        refs = {i: self.engines.handles[i].alive.remote() for i in indexes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=ALIVE_TIMEOUT_S)
        live = []
        for i, ref in refs.items():
            if ref not in ready:
                continue  # no answer in time: left out of this sync
            try:
                if ray.get(ref):
                    live.append(i)
                else:
                    ray.get(self.manager.report_engine_failure.remote(i, "its server process died (found by the "
                                                                          "weight sync)"))
            except ray.exceptions.RayError as exc:
                if actor_gone(exc):
                    ray.get(self.manager.mark_engine_lost.remote(i, f"its actor died ({type(exc).__name__})"))
        return live

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
        """Leave the weight-update group (skipped when ``fast``: a busy or dead trainer would stall it) and end
        replacement engines still starting."""
        import ray

        if self.weight_sync is not None and not fast:
            self.weight_sync.shutdown()
        self.weight_sync = None
        for handle, _ in self._starting.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=30)
            except Exception:  # it may be dead already
                pass
            ray.kill(handle, no_restart=True)
        self._starting.clear()
