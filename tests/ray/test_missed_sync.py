"""A real run with two engines and fault tolerance: an engine's server dies between a step's rollout and its
sync. The sync is redone without it, and the next step sends it NOTHING (before, the manager kept routing to
it: half the step's requests failed and were retried); the sync after that restarts it, brings it back with the
current weights, and it serves again.

The server is killed by the pid this test's run started (its argv names this test's temp dir), from the
``custom_reward_post_process_function`` hook, which the rollout manager runs at the end of a step's rollout.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL
from raygym.presets import tiny

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _hooks_travel_by_value():
    """The hook lives in this test module, which Ray workers cannot import: pickle it by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def server_ports(run_dir: Path) -> dict[int, str]:
    """pid -> port of the raygym servers whose argv names ``run_dir`` (this run's model cache)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "raygym.engines.raygym_server.server" in argv and any(str(run_dir) in a for a in argv):
            found[int(pid)] = argv[argv.index("--port") + 1]
    return found


def kill_a_server_after_the_first_rollout(run_dir: Path) -> Any:
    """A post-process hook that, at the end of the run's first rollout, kills one engine's server and writes
    that engine's index to ``run_dir/killed``."""

    def hook(samples: list[Any]) -> None:
        marker = run_dir / "killed"
        if marker.exists():
            return
        pid, port = max(server_ports(run_dir).items())
        (engine,) = {s.engine.split()[1] for s in samples if s.engine.endswith(f":{port})")}
        os.kill(pid, signal.SIGKILL)
        marker.write_text(engine)

    return hook


def test_an_engine_that_missed_the_sync_gets_no_requests(ray_local, tmp_path):
    from raygym.run.driver import train

    recipe = Recipe(**{**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                       "global_batch_size": 16, "num_rollout": 3, "save_interval": 1000, "rollout_num_gpus": 2,
                       "use_fault_tolerance": True,
                       "custom_reward_post_process_function": kill_a_server_after_the_first_rollout(tmp_path)})
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=TINY_MODEL),
                      dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK), output_dir=str(tmp_path))
    result = train(cfg)

    assert result.final_step == 2
    dead = int((tmp_path / "killed").read_text())
    other = 1 - dead
    rows = {r["step"]: r for r in result.steps}
    # step 0's sync (its server died after step 0's rollout) reached only the other engine ...
    assert rows[0]["sync/engines"] == 1 and rows[0]["sync/engine_rebuilds"] >= 1
    # ... so step 1 sent the dead engine nothing, and nothing failed, moved or waited to be retried
    step1 = rows[1]
    assert step1[f"rollout/engine{dead}_requests"] == 0 and step1[f"rollout/engine{other}_requests"] == 16
    assert step1["rollout/engine_failures"] == 0 and step1["rollout/request_retries"] == 0
    assert step1["rollout/requests_moved"] == 0 and step1["rollout/malformed_answers"] == 0
    assert step1["rollout/samples"] == 16
    assert {step1["rollout/weight_version_min"], step1["rollout/weight_version_max"]} == {1}
    # the next sync restarted it and brought it back with the current weights: it serves step 2
    assert rows[1]["sync/engines"] == 2
    assert rows[2][f"rollout/engine{dead}_requests"] > 0 and rows[2][f"rollout/engine{other}_requests"] > 0
    assert all(r["sync/full_resyncs"] == 0 for r in rows.values())
