"""EngineFleet's side of a sync that misses an engine, with engine and manager actors on a local Ray cluster:
the manager is told exactly which engines the sync reached (never "all of them"), an engine left out leaves
rotation right after the push (before publish: a resumed run's first push has none), a dead server found by the
sync is reported so that the manager restarts it, and an engine that still does not answer does not make every
later sync re-form the group. The weight-update group itself is replaced by a recorder (``connect``): what is
checked here is which engines the fleet syncs and what it tells the manager."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from raygym.config import Recipe
from raygym.engines import fleet as engine_fleet
from raygym.engines.fleet import EngineFleet
from raygym.engines.router import Router
from raygym.errors import WeightSyncError
from raygym.presets import tiny

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _stubs_travel_by_value():
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class EngineStub:
    """An engine actor whose server is ``up``, ``dead`` (alive() is False) or ``silent`` (alive() hangs)."""

    def __init__(self, index: int, mode: str = "up") -> None:
        self.index, self.mode, self.restarts = index, mode, 0

    def set_mode(self, mode: str) -> None:
        self.mode = mode

    def restart(self) -> None:  # what the manager's health check does: a new server, on another port
        self.restarts += 1

    def alive(self) -> bool:
        if self.mode == "silent":
            time.sleep(3600)
        return self.mode == "up"

    def url(self) -> str:
        return f"http://127.0.0.1:{9000 + self.index + 100 * self.restarts}"


class ManagerStub:
    """The RolloutManager methods the fleet calls, over a real Router; it records what it was told."""

    def __init__(self, n: int) -> None:
        self.router = Router(n)
        self.told: list[tuple[Any, ...]] = []

    def engine_states(self) -> list[str]:
        return [self.router.state(i) for i in range(self.router.num_engines)]

    def hold_back(self, engines: list[int]) -> list[int]:
        self.told.append(("hold_back", sorted(engines)))
        return self.router.hold_back(engines)

    def apply_sync(self, version: int, reached: list[int]) -> list[int]:
        self.told.append(("apply_sync", version, sorted(reached)))
        return self.router.apply_sync(version, reached)

    def report_engine_failure(self, i: int, reason: str) -> None:
        self.told.append(("failed", i))
        self.router.mark_unhealthy(i)

    def mark_engine_lost(self, i: int, reason: str) -> None:
        self.told.append(("lost", i))
        self.router.mark_lost(i)

    def restart_done(self, i: int) -> None:  # what the manager's background restart ends with
        self.router.mark_restarted(i)

    def versions(self) -> list[int | None]:
        return [self.router.version(i) for i in range(self.router.num_engines)]

    def log(self) -> list[tuple[Any, ...]]:
        return list(self.told)


class Group:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles


class RecordedSync:
    """Stands for the weight-update group over ``engines``: ``push`` fails ``failures`` times first."""

    cost_model = None

    def __init__(self, engines: list[int], failures: int = 0) -> None:
        self.engines, self.failures, self.pushed = engines, failures, []

    def push(self, version: int) -> dict[str, float]:
        if self.failures:
            self.failures -= 1
            raise WeightSyncError(f"version {version}: an engine did not answer")
        self.pushed.append(version)
        return {}

    def shutdown(self) -> None:
        pass


def make_fleet(ray: Any, modes: list[str]) -> tuple[EngineFleet, Any, list[Any], list[list[int]]]:
    engine = ray.remote(num_cpus=0)(EngineStub)
    handles = [engine.remote(i, mode) for i, mode in enumerate(modes)]
    manager = ray.remote(num_cpus=0)(ManagerStub).remote(len(modes))
    recipe = Recipe(**{**tiny().model_dump(), "rollout_num_gpus": len(modes), "use_fault_tolerance": True})
    said: list[str] = []
    fleet = EngineFleet(recipe, Group(handles), Group([]), manager, say=said.append)
    groups: list[list[int]] = []

    def connect(indexes: list[int]) -> None:  # the weight-update group: recorded, not formed (at these addresses)
        groups.append(list(indexes))
        fleet.urls = [ray.get(h.url.remote()) if i in indexes else "" for i, h in enumerate(handles)]
        fleet.weight_sync, fleet.synced = RecordedSync(list(indexes)), list(indexes)

    fleet.connect = connect  # type: ignore[method-assign]
    fleet.connect(list(range(len(modes))))
    return fleet, manager, handles, groups


def test_a_dead_server_is_left_out_held_back_restarted_and_brought_back(ray_local) -> None:
    ray = ray_local
    fleet, manager, handles, groups = make_fleet(ray, ["up", "up"])
    try:
        ray.get(handles[1].set_mode.remote("dead"))  # its server died after the rollout
        fleet.weight_sync.failures = 1
        fleet.push(1)
        assert fleet.synced == [0] and groups == [[0, 1], [0]]
        assert ray.get(manager.log.remote()) == [("failed", 1), ("hold_back", [1])]  # restarted, out at once
        fleet.publish(1)
        assert ray.get(manager.log.remote())[-1] == ("apply_sync", 1, [0])  # only the engine the sync reached
        assert ray.get(manager.engine_states.remote()) == ["healthy", "dead"]
        assert ray.get(manager.versions.remote())[0] == 1

        ray.get(handles[1].set_mode.remote("up"))  # the manager restarted its server
        ray.get(manager.restart_done.remote(1))
        fleet.push(2)
        fleet.publish(2)
        assert groups[-1] == [0, 1] and fleet.synced == [0, 1]  # re-formed over it: it gets the weights
        assert ray.get(manager.engine_states.remote()) == ["healthy", "healthy"]
        assert ray.get(manager.versions.remote()) == [2, 2]
    finally:
        for h in [*handles, manager]:
            ray.kill(h)


def test_a_silent_engine_stays_out_without_re_forming_every_sync(ray_local, monkeypatch) -> None:
    ray = ray_local
    monkeypatch.setattr(engine_fleet, "ALIVE_TIMEOUT_S", 1.0)
    fleet, manager, handles, groups = make_fleet(ray, ["up", "silent"])
    try:
        fleet.weight_sync.failures = 1  # its node stopped answering between the rollout and the sync
        fleet.push(1)
        assert fleet.synced == [0]
        assert ray.get(manager.log.remote()) == [("hold_back", [1])]  # not reported failed: it did not answer
        assert fleet.publish(1) == {"sync/engines": 1.0, "sync/engines_replaced": 0.0}
        assert ray.get(manager.engine_states.remote()) == ["healthy", "needs_weights"]
        assert ray.get(manager.versions.remote()) == [1, 0]  # it still holds version 0, and is not labelled 1

        rebuilt = len(groups)
        fleet.push(2)  # still silent: asked again, left out again, and the group over engine 0 stays as it is
        fleet.publish(2)
        assert len(groups) == rebuilt and fleet.weight_sync.pushed == [1, 2]
        assert ray.get(manager.engine_states.remote()) == ["healthy", "needs_weights"]
    finally:
        for h in [*handles, manager]:
            ray.kill(h)


def test_an_engine_restarted_during_the_sync_is_synced_at_its_new_address(ray_local) -> None:
    """The manager's health check restarted engine 1 while the trainer pushed (the push failed on its old
    address): the fleet re-forms the sync over both engines at their current addresses and pushes again, rather
    than failing the run; a failure on engines that all stayed where they were still fails it."""
    ray = ray_local
    fleet, manager, handles, groups = make_fleet(ray, ["up", "up"])
    try:
        ray.get(manager.report_engine_failure.remote(1, "/health_generate failed"))  # the manager's health check
        ray.get(handles[1].restart.remote())  # ... restarts it: a new server on another port
        ray.get(manager.restart_done.remote(1))  # back, without traffic until a sync reaches it
        fleet.weight_sync.failures = 1
        fleet.push(1)
        assert groups == [[0, 1], [0, 1]] and fleet.synced == [0, 1] and fleet.weight_sync.pushed == [1]
        assert ray.get(manager.log.remote()) == [("failed", 1)]  # only the health check's report: nobody held back
        fleet.publish(1)
        assert ray.get(manager.versions.remote()) == [1, 1]
        assert fleet.urls == ["http://127.0.0.1:9000", "http://127.0.0.1:9101"]

        fleet.weight_sync.failures = 1  # both engines are where the group was formed: a real failure
        with pytest.raises(WeightSyncError, match="an engine did not answer"):
            fleet.push(2)
        assert len(groups) == 2
    finally:
        for h in [*handles, manager]:
            ray.kill(h)
