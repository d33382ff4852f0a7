"""Where requests go when an engine misbehaves, over real HTTP servers on 127.0.0.1 and engine actors on a local
Ray cluster:

- a request in flight on an engine that leaves rotation (its health check fails, its actor is lost, a sync
  missed it) is cancelled there and answered by the other engine at once, not at the request's timeout;
- a malformed answer (the body does not fit the protocol, or a batch gets the wrong number of outputs) fails
  that request only: counted, sent to the other engine, and the engine is not restarted; a 5xx still is.

The servers are aiohttp apps in the test's event loop; the engine actors only hand out their URL and count the
restarts the pool asks for.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from raygym.config import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.health import EnginePool
from raygym.engines.router import DEAD, HEALTHY, LOST, NEEDS_WEIGHTS
from raygym.presets import tiny
from raygym.rollout.manager import RolloutManager

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

REQUEST_TIMEOUT_S = 120.0  # what a request stuck on a silent engine would wait without the move


@pytest.fixture(autouse=True)
def _stub_travels_by_value():
    """Ray workers cannot import this test module: pickle its classes by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def answer(prompt: list[int], token: int = 49) -> dict[str, Any]:
    """A valid /generate answer for one prompt: one token, with its log-prob."""
    return {"text": chr(token), "output_ids": [token], "meta_info": {
        "id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": len(prompt), "completion_tokens": 1,
        "output_token_logprobs": [[-0.5, token, None]]}}


class FakeEngine:
    """An HTTP engine on 127.0.0.1. ``mode``: ``good`` answers; ``silent`` accepts /generate and the health
    routes and never answers (a partitioned node); ``malformed`` answers 200 with a body the protocol rejects;
    ``short`` answers a batch with one output too few; ``error`` answers HTTP 500."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.generates = 0
        self.arrived = asyncio.Event()  # a /generate reached it
        self.dropped = asyncio.Event()  # a /generate it held was cancelled by the client (connection closed)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generates += 1
        self.arrived.set()
        ids = body["input_ids"]
        prompts = ids if ids and isinstance(ids[0], list) else [ids]
        if self.mode == "silent":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.dropped.set()
                raise
        if self.mode == "malformed":
            return web.json_response({"text": "7", "meta_info": {"finish_reason": "stop"}})  # no output_ids, no id
        if self.mode == "error":
            return web.json_response({"error": {"message": "CUDA error"}}, status=500)
        outputs = [answer(p) for p in prompts]
        if self.mode == "short":
            outputs = outputs[:-1]
        return web.json_response(outputs if isinstance(ids[0], list) else outputs[0])

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "silent":
            await asyncio.Event().wait()
        return web.Response(text="")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class EngineStub:
    """The engine actor's side the pool uses: its server's URL, and restarts (counted; the server stays)."""

    def __init__(self, url: str) -> None:
        self._url, self.restarts = url, 0

    def url(self) -> str:
        return self._url

    def restart(self) -> None:
        self.restarts += 1

    def restart_count(self) -> int:
        return self.restarts


async def with_engines(ray: Any, modes: list[str],
                       body: Callable[[list[FakeEngine], list[Any]], Awaitable[None]]) -> None:
    servers = [FakeEngine(mode) for mode in modes]
    stub = ray.remote(num_cpus=0)(EngineStub)
    handles = [stub.remote(await s.start()) for s in servers]
    try:
        await body(servers, handles)
    finally:
        for s in servers:
            await s.stop()
        for h in handles:
            ray.kill(h)


def leave_by_health_check(pool: EnginePool) -> None:
    pool.monitor.activate()  # first_wait 0: it probes engine 0 now, which does not answer


def leave_as_lost(pool: EnginePool) -> None:
    pool.mark_lost(0, "its actor is gone (test)")


def leave_by_missed_sync(pool: EnginePool) -> None:
    assert pool.apply_sync(1, reached=[1]) == [0]


@pytest.mark.parametrize("leave", [leave_by_health_check, leave_as_lost, leave_by_missed_sync],
                         ids=["health_check", "lost", "missed_sync"])
def test_a_request_in_flight_moves_at_once_when_its_engine_leaves_rotation(ray_local, leave) -> None:
    interval = 0.5

    async def body(servers: list[FakeEngine], handles: list[Any]) -> None:
        pool = EnginePool(handles, request_timeout=REQUEST_TIMEOUT_S, health_interval=interval,
                          health_timeout=interval, health_first_wait=0.0)
        await pool.start()
        try:
            request = asyncio.create_task(pool.request(GenerateRequest(input_ids=[[1, 2], [3]])))
            await servers[0].arrived.wait()  # round-robin starts at engine 0: the silent one holds it
            assert pool.router.outstanding(0) == 1 and not request.done()
            leave(pool)
            # the event: engine 0 left rotation; from then on the request needs no more than one answer elsewhere
            while pool.router.state(0) == HEALTHY:
                await asyncio.sleep(interval / 10)
            left = time.monotonic()
            engine, outputs = await asyncio.wait_for(request, timeout=10 * interval + 5)
            moved_in = time.monotonic() - left
            assert engine == 1 and isinstance(outputs, list) and len(outputs) == 2
            assert moved_in < 4 * interval, f"the request moved {moved_in:.2f}s after its engine left"
            assert pool.moved == 1 and pool.retries == 1 and pool.routed_rows == [2, 2]
            await asyncio.wait_for(servers[0].dropped.wait(), 10)  # cancelled on the silent engine, not left there
            assert pool.router.state(0) in (DEAD, LOST, NEEDS_WEIGHTS)
            # new requests go to engine 1 only
            for _ in range(3):
                assert (await pool.request(GenerateRequest(input_ids=[5])))[0] == 1
            assert servers[0].generates == 1
        finally:
            await pool.close()

    asyncio.run(with_engines(ray_local, ["silent", "good"], body))


@pytest.mark.parametrize("mode", ["malformed", "short"])
def test_a_malformed_answer_fails_only_its_request(ray_local, mode) -> None:
    async def body(servers: list[FakeEngine], handles: list[Any]) -> None:
        pool = EnginePool(handles, request_timeout=REQUEST_TIMEOUT_S)
        await pool.start()
        try:
            engine, outputs = await pool.request(GenerateRequest(input_ids=[[1, 2], [3]]))
            assert engine == 1 and isinstance(outputs, list) and len(outputs) == 2
            assert servers[0].generates == 1 and servers[1].generates == 1  # answered badly once, then elsewhere
            assert pool.malformed == 1 and pool.retries == 1 and pool.failures == []
            assert pool.router.state(0) == HEALTHY  # still in rotation: the next request goes there again
            await pool.request(GenerateRequest(input_ids=[[4], [5]]))
            assert servers[0].generates == 2 and pool.malformed == 2
            await pool.wait_for_recoveries()
            assert ray_local.get(handles[0].restart_count.remote()) == 0  # never restarted
        finally:
            await pool.close()

    asyncio.run(with_engines(ray_local, [mode, "good"], body))


def test_a_5xx_still_restarts_the_engine(ray_local) -> None:
    async def body(servers: list[FakeEngine], handles: list[Any]) -> None:
        pool = EnginePool(handles, request_timeout=REQUEST_TIMEOUT_S)
        await pool.start()
        try:
            engine, _ = await pool.request(GenerateRequest(input_ids=[1]))
            assert engine == 1 and pool.malformed == 0 and len(pool.failures) == 1
            await pool.wait_for_recoveries()
            assert ray_local.get(handles[0].restart_count.remote()) == 1
            assert pool.router.state(0) == NEEDS_WEIGHTS  # restarted: back once it holds the current weights
        finally:
            await pool.close()

    asyncio.run(with_engines(ray_local, ["error", "good"], body))


def test_the_step_counts_malformed_answers(ray_local, tiny_model_path, tmp_path) -> None:
    """A whole rollout step: the part sent to the malformed engine is generated by the other one; the step has
    every sample, ``rollout/malformed_answers`` counts it, and no engine failed or restarted."""
    prompts = tmp_path / "digits.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"next:{i}=", "label": str((i + 1) % 10)}) + "\n"
                               for i in range(10)))
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 2, "global_batch_size": 8,
              "rollout_max_response_len": 4, "rm_type": "next_digit", "use_fault_tolerance": True}
    cfg = TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=tiny_model_path),
                      dataset=DatasetConfig(prompt_data=str(prompts)))

    async def body(servers: list[FakeEngine], handles: list[Any]) -> None:
        manager = RolloutManager(cfg, handles, tiny_model_path)
        try:
            samples = await manager.generate(rollout_id=0, weight_version=0)
            m = manager.metrics()
            assert len(samples) == 8 and all(s.response_text == "1" for s in samples)
            assert m["rollout/malformed_answers"] >= 1 and m["rollout/engine_failures"] == 0
            assert m["rollout/request_retries"] == m["rollout/malformed_answers"]
            assert all(s.engine.startswith("engine 1 ") for s in samples)
            assert manager.engine_states() == ["healthy", "healthy"]
            assert ray_local.get(handles[0].restart_count.remote()) == 0
        finally:
            await manager.close()

    asyncio.run(with_engines(ray_local, ["malformed", "good"], body))
