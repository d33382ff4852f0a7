"""The one HTTP client of the engine API (:mod:`raygym.engine_api.protocol`): SGLang's native API, raygym's server,
raygym's vLLM adapter.

Every request is a model of the protocol, sent to an :class:`~raygym.engine_api.protocol.Endpoint` on the method
:data:`~raygym.engine_api.protocol.ROUTES` names; every answer is parsed by that route's answer model. Failures
raise :class:`EngineHTTPError` (the server answered with an error status) or :class:`EngineConnectionError`
(no answer), both naming the URL and the endpoint.

aiohttp, not httpx: rollouts send hundreds of requests at once, and measured here 64 concurrent requests
cost ~25 ms through aiohttp and ~750 ms through ``httpx.AsyncClient``, whose pool degrades with
concurrency; raygym's servers are aiohttp too. Synchronous callers on threads (the weight sync's control
calls, the EngineActor's methods) run it on a private event loop thread (:class:`LoopThread`,
:func:`shared_loop`). Idle pooled connections are dropped after :data:`KEEPALIVE_S` seconds, well before
the servers drop theirs (uvicorn, under SGLang: 5 s), so a request never races a server closing its end.

>>> import asyncio
>>> from raygym.engine_api.protocol import GenerateRequest
>>> async def demo(url):
...     async with EngineClient(url) as c:
...         out = await c.generate(GenerateRequest(input_ids=[5, 6], sampling_params={"max_new_tokens": 4}))
...         return out.finish_type
>>> # asyncio.run(demo("http://127.0.0.1:30000"))
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import pydantic

from raygym.engine_api.auth import auth_headers
from raygym.engine_api.protocol import (
    ROUTES,
    AbortRequest,
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    Endpoint,
    EngineStats,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroup,
    MemoryTags,
    ModelInfo,
    PauseGeneration,
    StatusAnswer,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    WeightsChecksum,
    WeightsChecksumResponse,
    WeightUpdateResult,
    body_json,
    request_body,
    stream_payload,
)
from raygym.errors import RaygymError

T = TypeVar("T")
KEEPALIVE_S = 2.0


class EngineHTTPError(RaygymError):
    """The server answered with a non-2xx status."""

    def __init__(self, url: str, endpoint: str, status: int, body: str) -> None:
        self.url, self.endpoint, self.status, self.body = url, endpoint, status, body
        super().__init__(f"{url}{endpoint} answered HTTP {status}: {body[:500]}")

    def message(self) -> str:
        """The server's own message (SGLang's ``{"message"}``, raygym's ``{"error": {"message"}}``), else the body."""
        try:
            parsed = json.loads(self.body)
        except ValueError:
            return self.body[:500]
        if isinstance(parsed, dict):
            error = parsed.get("error", parsed)
            text = error.get("message") if isinstance(error, dict) else error
            if isinstance(text, str) and text:
                return text[:500]
        return self.body[:500]


class EngineConnectionError(RaygymError):
    """The server could not be reached or did not answer in time."""


class EngineAnswerError(RaygymError):
    """The server answered 2xx with a body the protocol's answer model does not accept."""


def parse_answer(endpoint: Endpoint, data: Any) -> Any:
    """``data`` (decoded JSON) as the answer model of ``endpoint``; a list for a batched ``/generate``; None for
    routes whose body carries nothing to read."""
    model = ROUTES[endpoint].answer
    if model is None:
        return None
    try:
        if isinstance(data, list) and endpoint is Endpoint.GENERATE:
            return [model.model_validate(item) for item in data]
        return model.model_validate({} if data is None else data)
    except pydantic.ValidationError as exc:
        raise EngineAnswerError(f"{endpoint.value}: the answer does not fit {model.__name__}: {exc}") from exc


class EngineClient:
    """Async client for one engine URL (``http://host:port``).

    ``timeout`` bounds every request (seconds); generation calls may pass a longer one.
    Use it as an async context manager, or call :meth:`aclose`. Every request carries the run's engine
    API key (:mod:`raygym.engine_api.auth`) when this process has one.
    """

    def __init__(self, base_url: str, timeout: float = 600.0, max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._loop = None

    def _get_session(self) -> aiohttp.ClientSession:
        # A session belongs to the loop it was made on: made lazily, remade on another loop.
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(self.timeout, 10.0)),
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S),
                trust_env=False,  # never route engine traffic through a proxy from the environment
            )
            self._loop = loop
        return self._session

    def _options(self, body: bytes | None, timeout: float | None) -> dict[str, Any]:
        # the key is read per request: a process may be handed its run's key after the client was made
        headers = {**auth_headers(), **({"Content-Type": "application/json"} if body is not None else {})}
        options: dict[str, Any] = {"headers": headers}
        if body is not None:
            options["data"] = body
        if timeout is not None:
            options["timeout"] = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 10.0))
        return options

    async def _request(self, endpoint: Endpoint, body: bytes | None, timeout: float | None) -> bytes:
        """Send one request; returns the body of a 2xx answer."""
        session = self._get_session()
        method = ROUTES[endpoint].method
        try:
            async with session.request(method, self.base_url + endpoint.value, **self._options(body, timeout)) as r:
                data = await r.read()
                status = r.status
        except asyncio.TimeoutError as exc:
            raise EngineConnectionError(f"{self.base_url}{endpoint.value}: no answer in time") from exc
        except aiohttp.ClientError as exc:
            raise EngineConnectionError(f"{self.base_url}{endpoint.value}: {type(exc).__name__}: {exc}") from exc
        if status >= 400:
            raise EngineHTTPError(self.base_url, endpoint.value, status, data.decode(errors="replace"))
        return data

    async def send_json(self, endpoint: Endpoint, body: Any = None, *, timeout: float | None = None) -> Any:
        """Send ``body`` (the route's request model; None for routes without one) and return the decoded JSON
        answer (None for an empty body, ``{"text": ...}`` for a text body)."""
        checked = request_body(endpoint, body)
        data = await self._request(endpoint, None if checked is None else body_json(checked), timeout)
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return {"text": data.decode(errors="replace")}

    async def send(self, endpoint: Endpoint, body: Any = None, *, timeout: float | None = None) -> Any:
        """Send ``body`` to ``endpoint`` and return its answer model (see :func:`parse_answer`)."""
        return parse_answer(endpoint, await self.send_json(endpoint, body, timeout=timeout))

    # ----- generation -----
    async def generate(self, request: GenerateRequest, *, timeout: float | None = None
                       ) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate: one answer for one prompt, a list for a batch (or ``n`` > 1)."""
        answer: GenerateResponse | list[GenerateResponse] = await self.send(Endpoint.GENERATE, request, timeout=timeout)
        return answer

    async def generate_stream(self, request: GenerateRequest, *, timeout: float | None = None
                              ) -> AsyncIterator[GenerateResponse]:
        """POST /generate with ``stream: true``: each update as it comes (a whole answer so far; ``index`` = its
        row in a batch). Ends at ``data: [DONE]``; an error the server sends inside the stream raises
        :class:`EngineHTTPError` (status 500 unless it names one)."""
        body = body_json(request.model_copy(update={"stream": True}))
        session = self._get_session()
        url = self.base_url + Endpoint.GENERATE.value
        try:
            async with session.post(url, **self._options(body, timeout)) as r:
                if r.status >= 400:
                    raise EngineHTTPError(self.base_url, Endpoint.GENERATE.value, r.status,
                                          (await r.read()).decode(errors="replace"))
                buffer = b""
                async for piece in r.content.iter_any():
                    buffer += piece
                    while b"\n\n" in buffer:
                        frame, buffer = buffer.split(b"\n\n", 1)
                        payload = stream_payload(frame)
                        if payload is None:
                            continue
                        if payload == b"[DONE]":
                            return
                        yield self._chunk(payload)
        except asyncio.TimeoutError as exc:
            raise EngineConnectionError(f"{url}: no answer in time") from exc
        except aiohttp.ClientError as exc:
            raise EngineConnectionError(f"{url}: {type(exc).__name__}: {exc}") from exc
        raise EngineConnectionError(f"{url}: the stream ended before data: [DONE]")

    def _chunk(self, payload: bytes) -> GenerateResponse:
        data = json.loads(payload)
        if isinstance(data, dict) and "error" in data:
            error = data["error"] if isinstance(data["error"], dict) else {"message": str(data["error"])}
            code = error.get("code")
            raise EngineHTTPError(self.base_url, Endpoint.GENERATE.value, code if isinstance(code, int) else 500,
                                  json.dumps(data))
        answer: GenerateResponse = parse_answer(Endpoint.GENERATE, data)
        return answer

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        await self.send(Endpoint.ABORT_REQUEST, AbortRequest(rid=rid, abort_all=abort_all))

    async def pause_generation(self, mode: str = "abort") -> StatusAnswer:
        """Pass the mode explicitly: ``abort`` | ``in_place`` | ``retract``."""
        answer: StatusAnswer = await self.send(Endpoint.PAUSE_GENERATION, PauseGeneration(mode=mode))  # type: ignore[arg-type]
        return answer

    async def continue_generation(self) -> StatusAnswer:
        answer: StatusAnswer = await self.send(Endpoint.CONTINUE_GENERATION, ContinueGeneration())
        return answer

    async def flush_cache(self) -> bool:
        """True when flushed; False when the server refused because requests are pending."""
        try:
            await self.send(Endpoint.FLUSH_CACHE)
        except EngineHTTPError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    # ----- health and info -----
    async def health(self) -> bool:
        try:
            await self.send(Endpoint.HEALTH, timeout=min(self.timeout, 10.0))
        except (EngineHTTPError, EngineConnectionError):
            return False
        return True

    async def health_generate(self, timeout: float = 30.0) -> bool:
        """True when the server ran a token through its model within ``timeout`` seconds."""
        try:
            await self.send(Endpoint.HEALTH_GENERATE, timeout=timeout)
        except (EngineHTTPError, EngineConnectionError):
            return False
        return True

    async def get_model_info(self) -> ModelInfo:
        """``/model_info`` (SGLang's current name; ``/get_model_info`` is deprecated there)."""
        answer: ModelInfo = await self.send(Endpoint.MODEL_INFO)
        return answer

    async def stats(self) -> EngineStats:
        """raygym extension ``/raygym/stats`` (batching counters; raygym's server and vLLM adapter)."""
        answer: EngineStats = await self.send(Endpoint.RAYGYM_STATS)
        return answer

    async def wait_healthy(
        self, proc_alive: Callable[[], bool], timeout: float, interval: float = 0.5
    ) -> None:
        """Poll /health_generate until it answers 200, while checking the server process lives.

        Raises :class:`EngineConnectionError` when the process exits or ``timeout`` passes.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not proc_alive():
                raise EngineConnectionError(
                    f"{self.base_url}: the server process exited before it became healthy"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineConnectionError(
                    f"{self.base_url}: not healthy after {timeout:.0f} s (/health_generate)"
                )
            if await self.health_generate(timeout=max(1.0, min(left, 30.0))):
                return
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    # ----- memory -----
    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.send(Endpoint.RELEASE_MEMORY, MemoryTags(tags=tags) if tags else MemoryTags())  # type: ignore[arg-type]

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.send(Endpoint.RESUME_MEMORY, MemoryTags(tags=tags) if tags else MemoryTags())  # type: ignore[arg-type]

    # ----- weights -----
    async def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                       weight_version: str | int | None = None,
                                       abort_all_requests: bool = False) -> WeightUpdateResult:
        request = UpdateWeightsFromDisk(model_path=model_path, load_format=load_format,
                                        abort_all_requests=abort_all_requests,
                                        **_version(weight_version))  # type: ignore[arg-type]
        answer: WeightUpdateResult = await self.send(Endpoint.UPDATE_WEIGHTS_FROM_DISK, request)
        return answer

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> WeightUpdateResult:
        """Join a weight-update group; the sender (rank 0) must join at the same time."""
        request = InitWeightsUpdateGroup.model_validate({
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})
        answer: WeightUpdateResult = await self.send(Endpoint.INIT_WEIGHTS_UPDATE_GROUP, request)
        return answer

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | int | None = None,
                                              load_format: str | None = None) -> WeightUpdateResult:
        """Receive ``names`` by broadcast from rank 0 of the group (the sender broadcasts meanwhile)."""
        request = UpdateWeightsFromDistributed(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                               flush_cache=flush_cache, load_format=load_format,
                                               **_version(weight_version))  # type: ignore[arg-type]
        answer: WeightUpdateResult = await self.send(Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, request)
        return answer

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightUpdateResult:
        answer: WeightUpdateResult = await self.send(Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP,
                                                     DestroyWeightsUpdateGroup(group_name=group_name))
        return answer

    async def weights_checksum(self, names: list[str] | None = None) -> WeightsChecksumResponse:
        """raygym extension: ``{"weight_version", "checksums": {name: xxh3 hex}}``."""
        answer: WeightsChecksumResponse = await self.send(Endpoint.RAYGYM_WEIGHTS_CHECKSUM, WeightsChecksum(names=names))
        return answer


def _version(weight_version: str | int | None) -> dict[str, str]:
    return {} if weight_version is None else {"weight_version": str(weight_version)}


class LoopThread:
    """An asyncio loop on a daemon thread, so synchronous code can await the async client."""

    def __init__(self, name: str = "raygym-engine-http") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop() -> LoopThread:
    """The process's loop thread for synchronous engine calls (made on first use, lives with the process)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread("raygym-engine-sync-http")
        return _shared


__all__ = ["KEEPALIVE_S", "EngineAnswerError", "EngineClient", "EngineConnectionError", "EngineHTTPError",
           "LoopThread", "parse_answer", "shared_loop"]
