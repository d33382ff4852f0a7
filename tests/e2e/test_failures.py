"""Failure behaviour of a real run: an engine server killed mid-run is restarted and re-synced and the
run finishes; a trainer actor killed mid-run fails the run with a RaygymError naming the trainer and
the last complete checkpoint (which stays intact); Ctrl-C releases every actor, placement group and
server process.

Processes are killed by the pids this test's own run started: a server is found by its argv (which
names this test's temp dir), a trainer through this test's own Ray cluster's actor table.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL
from raygym.errors import RaygymError
from raygym.presets import tiny

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def tiny_config(out: Path, **overrides: Any) -> TrainConfig:
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 4,
              "global_batch_size": 16, "num_rollout": 3, "save_interval": 1000, **overrides}
    return TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=TINY_MODEL),
                       dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK), output_dir=str(out))


@pytest.fixture(autouse=True)
def _hooks_travel_by_value():
    """The log hooks below live in this test module, which Ray workers cannot import; the config
    (hooks included) travels to the actors, so pickle this module's functions by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def server_pids(run_dir: Path) -> dict[int, str]:
    """pid -> URL of the raygym servers whose argv names ``run_dir`` (this run's model cache)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "raygym.engines.raygym_server.server" in argv and any(str(run_dir) in a for a in argv):
            found[int(pid)] = f"http://{argv[argv.index('--host') + 1]}:{argv[argv.index('--port') + 1]}"
    return found


def alive_actors(class_name: str | None = None) -> list[dict[str, Any]]:
    """ALIVE actors of this process's Ray cluster (optionally of one class)."""
    from ray._private import state

    return [a for a in state.actors().values()
            if a.get("State") == "ALIVE" and (class_name is None or class_name in str(a.get("ActorClassName")))]


def assert_released(run_dir: Path, actors_before: set[str]) -> None:
    import ray

    groups = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups
    left = {a["ActorID"] for a in alive_actors()} - actors_before
    assert not left, left
    deadline = time.monotonic() + 15
    while server_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server_pids(run_dir) == {}


def test_engine_killed_mid_run_is_restarted_and_resynced(ray_local, tmp_path):
    from raygym.run.driver import train

    killed: list[int] = []

    def kill_engine_after_step_0(rollout_id: int, samples: list[Any], row: dict[str, Any]) -> None:
        if rollout_id == 0:  # the rollout of step 1 is already in flight
            pid = max(server_pids(tmp_path))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    cfg = tiny_config(tmp_path, rollout_num_gpus=2, num_rollout=4, use_fault_tolerance=True,
                      custom_rollout_log_function=kill_engine_after_step_0)
    result = train(cfg)

    assert result.final_step == 3 and len(killed) == 1
    rows = {r["step"]: r for r in result.steps}
    assert sum(r["rollout/engine_failures"] for r in rows.values()) + rows[3].get("sync/engine_rebuilds", 0) >= 1
    assert max(r.get("sync/engine_rebuilds", 0) for r in rows.values()) >= 1  # re-formed over the new server
    assert all(r["sync/full_resyncs"] == 0 for r in rows.values())
    # back in rotation with the current weights: both engines serve the last step
    assert rows[3]["sync/engines"] == 2
    assert rows[3]["rollout/engine0_requests"] > 0 and rows[3]["rollout/engine1_requests"] > 0
    assert all(r["rollout/samples"] == 16 for r in rows.values())


def test_trainer_killed_fails_with_clear_error_and_intact_checkpoint(ray_local, tmp_path):
    from raygym.checkpoint.store import latest_checkpoint, load_checkpoint
    from raygym.run.driver import train

    actors_before = {a["ActorID"] for a in alive_actors()}

    def kill_trainer_after_step_1(rollout_id: int, samples: list[Any], row: dict[str, Any]) -> None:
        if rollout_id == 1:
            (trainer,) = alive_actors("TrainerActor")
            os.kill(int(trainer["Pid"]), signal.SIGKILL)

    cfg = tiny_config(tmp_path, num_rollout=4, save_interval=1, custom_rollout_log_function=kill_trainer_after_step_1)
    with pytest.raises(RaygymError) as info:
        train(cfg)
    message = str(info.value)
    assert "trainer rank 0 died" in message
    assert str(tmp_path / "checkpoints" / "iter_0000001") in message
    last = latest_checkpoint(str(tmp_path / "checkpoints"))
    assert last.rollout_id == 1
    ckpt = load_checkpoint(last.path)
    assert ckpt.extra["data_state"]["train"]["offset"] == 8 and ckpt.model_state
    assert_released(tmp_path, actors_before)


def test_ctrl_c_releases_everything(ray_local, tmp_path):
    from raygym.checkpoint.store import list_checkpoints
    from raygym.run.driver import train

    actors_before = {a["ActorID"] for a in alive_actors()}

    def interrupt_after_step_1(rollout_id: int, samples: list[Any], row: dict[str, Any]) -> None:
        if rollout_id == 1:
            raise KeyboardInterrupt  # what Ctrl-C raises in the driver's main thread

    cfg = tiny_config(tmp_path, num_rollout=4, save_interval=1, custom_rollout_log_function=interrupt_after_step_1)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    assert_released(tmp_path, actors_before)
    # only complete checkpoints count, and a step's checkpoint only with its rows: step 1 was interrupted before
    # it was logged, so its checkpoint (written before the sync) was never committed
    assert [c.rollout_id for c in list_checkpoints(str(tmp_path / "checkpoints"))] == [0]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]
