"""An engine whose actor is gone (its node died): the router keeps it out of rotation as ``lost``, the pool
retries its requests elsewhere and takes a replacement actor, which gets traffic only once it holds the
current weights. Engines and their HTTP clients are in-process fakes; the error is Ray's own
``ActorDiedError`` (what calling an actor on a dead node raises)."""

from __future__ import annotations

import asyncio
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError

from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.engines.health import EnginePool, actor_gone
from raygym.engines.router import HEALTHY, LOST, NEEDS_WEIGHTS, Router


class Call:
    """``handle.method.remote(...)`` of a fake actor: an awaitable returning ``value`` or raising ``error``."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error
        self.calls = 0

    def remote(self, *args: Any) -> Any:
        self.calls += 1

        async def answer() -> Any:
            if self.error is not None:
                raise self.error
            return self.value

        return answer()


class Engine:
    def __init__(self, url: str, restart_error: BaseException | None = None) -> None:
        self.url = Call(url)
        self.restart = Call(url, restart_error)


class Client:
    """An engine's HTTP client: answers /generate, or fails like a server whose node died."""

    def __init__(self, url: str, dead: set[str], served: list[str]) -> None:
        self.url, self.dead, self.served = url, dead, served

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if self.url in self.dead:
            raise ConnectionResetError(f"{self.url}: connection reset by peer")
        self.served.append(self.url)
        return GenerateResponse.model_validate({"text": "7", "output_ids": [7], "meta_info": {
            "id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": len(request.input_ids or []),
            "completion_tokens": 1}})

    async def aclose(self) -> None:
        pass


def test_router_lost_engine_gets_no_traffic_until_replaced_and_current() -> None:
    router = Router(2, weight_version=3)
    router.mark_lost(0)
    assert router.state(0) == LOST and not router.mark_unhealthy(0)  # lost is not "failed again"
    assert {router.acquire() for _ in range(4)} == {1}
    assert not router.mark_ready(0, 3)  # a lost engine is not ready however current its weights
    router.mark_restarted(0)  # a new actor serves it
    assert router.state(0) == NEEDS_WEIGHTS and not router.mark_ready(0, 2)
    assert router.mark_ready(0, 3) and router.state(0) == HEALTHY


def test_actor_gone_tells_death_from_unavailability() -> None:
    assert actor_gone(ActorDiedError())
    assert not actor_gone(ActorUnavailableError("the actor is restarting", b"0" * 16))
    assert not actor_gone(ConnectionResetError())


def test_pool_retries_elsewhere_marks_the_engine_lost_and_takes_a_replacement() -> None:
    async def scenario() -> None:
        dead: set[str] = set()
        served: list[str] = []
        engines = [Engine("http://10.0.0.12:1", restart_error=ActorDiedError()), Engine("http://10.0.0.13:1")]
        pool = EnginePool(engines, client_factory=lambda url: Client(url, dead, served), weight_version=5)
        await pool.start()
        dead.add("http://10.0.0.12:1")  # engine 0's node dies: its server resets every connection

        answers = await asyncio.gather(*(pool.request(GenerateRequest(input_ids=[1, 2])) for _ in range(6)))
        assert all(i == 1 for i, _ in answers) and len(served) == 6  # every request answered, by engine 1
        assert pool.retries >= 1
        await pool.wait_for_recoveries()
        assert pool.router.state(0) == LOST  # its restart met a dead actor: only a new actor can serve it
        assert engines[0].restart.calls == 1  # no retries against a dead actor
        assert any(f["reason"].startswith("lost:") for f in pool.failures)

        replacement = Engine("http://10.0.0.12:2")  # the node came back: a new actor, a new server
        await pool.replace_engine(0, replacement)
        assert pool.engines[0] is replacement and pool.urls[0] == "http://10.0.0.12:2"
        assert pool.router.state(0) == NEEDS_WEIGHTS
        await asyncio.gather(*(pool.request(GenerateRequest(input_ids=[3])) for _ in range(4)))
        assert "http://10.0.0.12:2" not in served  # no traffic before it holds the current weights
        assert not pool.mark_engine_synced(0, 4) and pool.mark_engine_synced(0, 5)
        await asyncio.gather(*(pool.request(GenerateRequest(input_ids=[3])) for _ in range(4)))
        assert "http://10.0.0.12:2" in served
        await pool.close()

    asyncio.run(scenario())


def test_a_lost_engine_reported_by_the_driver_is_taken_out_of_rotation() -> None:
    async def scenario() -> None:
        served: list[str] = []
        pool = EnginePool([Engine("http://a:1"), Engine("http://b:1")],
                          client_factory=lambda url: Client(url, set(), served))
        await pool.start()
        pool.mark_lost(1, "its actor died (ActorDiedError)")
        pool.mark_lost(1, "reported twice")  # idempotent
        assert pool.router.state(1) == LOST and len(pool.failures) == 1
        await asyncio.gather(*(pool.request(GenerateRequest(input_ids=[1])) for _ in range(3)))
        assert served == ["http://a:1"] * 3
        await pool.close()

    asyncio.run(scenario())


class Flaky(Call):
    """``restart`` of an actor that cannot be reached ``failures`` times, then restarts its server."""

    def __init__(self, value: Any, failures: int) -> None:
        super().__init__(value)
        self.failures = failures

    def remote(self, *args: Any) -> Any:
        self.error = ActorUnavailableError("its node is not answering", b"0" * 16) if self.calls < self.failures else None
        return super().remote(*args)


def test_an_unreachable_actor_is_asked_again_until_it_answers() -> None:
    async def scenario() -> None:
        engine = Engine("http://a:1")
        engine.restart = Flaky("http://a:1", failures=4)  # more than the attempts a failing server gets
        pool = EnginePool([engine, Engine("http://b:1")], client_factory=lambda url: Client(url, set(), []),
                          retry_interval_s=0.05)
        await pool.start()
        await pool.report_failure(0, "probe failed")
        await pool.wait_for_recoveries()
        assert engine.restart.calls == 5 and pool.router.state(0) == NEEDS_WEIGHTS
        await pool.close()

    asyncio.run(scenario())


def test_an_actor_unreachable_for_too_long_or_a_server_that_never_starts_is_lost() -> None:
    async def scenario(restart: Call, **pool_args: Any) -> str:
        engine = Engine("http://a:1")
        engine.restart = restart
        pool = EnginePool([engine, Engine("http://b:1")], client_factory=lambda url: Client(url, set(), []),
                          retry_interval_s=0.05, **pool_args)
        await pool.start()
        await pool.report_failure(0, "probe failed")
        await pool.wait_for_recoveries()
        assert pool.router.state(0) == LOST
        await pool.close()
        return str(pool.failures[-1]["reason"])

    assert "unreachable for" in asyncio.run(scenario(Flaky("u", failures=100), unreachable_for_s=0.3))
    failing = Call("u", RuntimeError("the model did not load"))
    assert "failed to restart 3 times" in asyncio.run(scenario(failing))
    assert failing.calls == 3
