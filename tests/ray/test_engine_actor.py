"""EngineActor inside local Ray: starts raygym's server, generates, survives a kill -9 via restart()."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raygym.engine_api.protocol import Endpoint, GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.presets import tiny

pytestmark = pytest.mark.ray


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_engine_actor_generates_detects_a_killed_server_and_restarts(ray_local, tiny_model_path, tmp_path):
    ray = ray_local
    Actor = ray.remote(num_cpus=0, max_concurrency=8)(EngineActor)
    actor = Actor.remote(
        tiny().replace(seed=3, sglang_max_running_requests=8),
        0,
        tiny_model_path,
        [],
        "127.0.0.1",
        "raygym",
        startup_timeout=180.0,
        device="cpu",
        log_dir=str(tmp_path),
    )
    try:
        url = ray.get(actor.start.remote(), timeout=240)
        assert url.startswith("http://127.0.0.1:")
        payload = GenerateRequest(input_ids=[[3, 4, 5], [6, 7]], return_logprob=True,
                                  sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
        first = ray.get([actor.generate.remote(payload) for _ in range(4)], timeout=120)
        ids = [[o["output_ids"] for o in out] for out in first]
        assert all(i == ids[0] for i in ids)  # greedy: concurrent calls agree
        assert [len(o["output_ids"]) for o in first[0]] == [6, 6]
        assert first[0][0]["meta_info"]["weight_version"] == "0"

        ray.get(actor.set_weight_version.remote(4))
        assert ray.get(actor.get_weight_version.remote()) == 4

        pid = ray.get(actor.pid.remote())
        assert ray.get(actor.alive.remote()) and ray.get(actor.health_generate.remote())
        os.kill(pid, signal.SIGKILL)  # the server process this test started, through the actor
        deadline = time.monotonic() + 20
        while ray.get(actor.alive.remote()):  # alive() polls, which also reaps the dead child
            assert time.monotonic() < deadline, "the actor did not notice its server died"
            time.sleep(0.1)
        assert _gone(pid)
        assert ray.get(actor.health_generate.remote()) is False

        new_url = ray.get(actor.restart.remote(), timeout=240)
        assert ray.get(actor.pid.remote()) != pid and ray.get(actor.alive.remote())
        assert new_url != url or ray.get(actor.health_generate.remote())
        again = ray.get(actor.generate.remote(payload), timeout=120)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first[0]]
        # The restarted server announces the version the actor tracks.
        assert again[0]["meta_info"]["weight_version"] == "4"
        info = ray.get(actor.call.remote(Endpoint.MODEL_INFO))
        assert info["model_path"] == tiny_model_path

        last_pid = ray.get(actor.pid.remote())
        ray.get(actor.shutdown.remote())
        assert _gone(last_pid)
        ray.get(actor.shutdown.remote())  # idempotent
        assert ray.get(actor.alive.remote()) is False
    finally:
        ray.get(actor.shutdown.remote(), timeout=60)
        ray.kill(actor)
