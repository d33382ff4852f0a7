"""Engine health for the rollout manager: routed requests with retry, failure handling, restarts,
and the periodic ``/health_generate`` monitor.

:class:`EnginePool` is the manager's only door to the engines. ``request(generate_request)`` picks an engine
through the :class:`~raygym.engines.router.Router`, posts ``/generate`` and, with fault tolerance
on, retries a request whose engine failed (connection error, timeout, 5xx) on another healthy
engine — the caller's sample slot is filled exactly once. The failed engine is marked unhealthy
and restarted in the background (``EngineActor.restart()``); it returns to the router only after
it holds the current weights: ``apply_sync(version, reached)`` (or ``mark_engine_synced(i, version)``) from
the driver's :class:`raygym.engines.fleet.EngineFleet` (see ``engines_needing_weights()``), which re-forms the
weight sync over the restarted engine and pushes to it. An engine a sync did not reach leaves rotation the
same way, without a restart.

A request in flight on an engine that leaves rotation (a failed request or health check, a lost actor, a
missed sync) is cancelled there and sent to another engine at once, not at its timeout. An answer that is
malformed (its body does not fit the protocol's model, or it has the wrong number of outputs) fails only
that request: it is counted (``malformed``) and sent elsewhere; the engine is not restarted.

:class:`HealthMonitor` probes every healthy engine's ``/health_generate`` every ``interval`` s with
``timeout``, starting ``first_wait`` s after it was first activated, and only while active (the
manager activates it during generate/eval; colocated engines release memory while trainers run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from raygym.engine_api.client import EngineAnswerError
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.engines.router import DEAD, HEALTHY, LOST, NoHealthyEngineError, Router
from raygym.errors import RaygymError

log = logging.getLogger(__name__)

ClientFactory = Callable[[str], Any]  # base_url -> EngineClient-like (async generate/health_generate/...)


class EngineRequestError(RaygymError):
    """The engine answered, but rejected the request (4xx): retrying elsewhere would not help."""


def _batch_size(request: GenerateRequest) -> int | None:
    """The number of prompts of a batched ``request`` (SGLang's list form); None for one prompt."""
    ids, text = request.input_ids, request.text
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def request_rows(request: GenerateRequest) -> int:
    """Prompts in ``request``: a batch's length, else 1."""
    return _batch_size(request) or 1


def answer_count_problem(request: GenerateRequest, answer: GenerateResponse | list[GenerateResponse]) -> str | None:
    """What is wrong with the number of outputs in ``answer`` to ``request`` (None: one per prompt and sample).

    >>> one = GenerateResponse.model_validate({"text": "7", "output_ids": [7],
    ...                                        "meta_info": {"id": "a", "finish_reason": {"type": "stop"}}})
    >>> answer_count_problem(GenerateRequest(input_ids=[[1], [2]]), [one])
    '2 prompts answered with 1 outputs'
    >>> answer_count_problem(GenerateRequest(input_ids=[1, 2]), one) is None
    True
    """
    params = request.sampling_params
    n = params.get("n", 1) if isinstance(params, dict) else 1  # samples per prompt (raygym sends 1)
    expected = request_rows(request) * (n if isinstance(n, int) else 1)
    if _batch_size(request) is None and expected == 1:
        return None if not isinstance(answer, list) else f"1 prompt answered with a list of {len(answer)} outputs"
    got = len(answer) if isinstance(answer, list) else 1
    return None if got == expected else f"{request_rows(request)} prompts answered with {got} outputs"


def default_client_factory(timeout: float | None) -> ClientFactory:
    def make(url: str) -> Any:
        from raygym.engine_api.client import EngineClient

        return EngineClient(url) if timeout is None else EngineClient(url, timeout=timeout)

    return make


def _status_code(exc: BaseException) -> int | None:
    """The HTTP status of an error the engine answered with (EngineHTTPError.status, httpx's response)."""
    for code in (getattr(exc, "status", None), getattr(getattr(exc, "response", None), "status_code", None)):
        if isinstance(code, int):
            return code
    return None


class HealthMonitor:
    """Calls ``check(i) -> bool`` for every engine in ``targets()`` every ``interval`` s, starting
    ``first_wait`` s after the first :meth:`activate`, only while active. ``check`` itself bounds
    its time and reports a failure (see :meth:`EnginePool.check_engine`)."""

    def __init__(
        self,
        check: Callable[[int], Awaitable[bool]],
        targets: Callable[[], list[int]],
        *,
        interval: float,
        first_wait: float,
    ) -> None:
        self._check, self._targets = check, targets
        self.interval, self.first_wait = interval, first_wait
        self._active = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.checks = 0  # completed check rounds

    def activate(self) -> None:
        """Start (or resume) checking; the first check waits ``first_wait`` s after the first activation."""
        self._active.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="raygym-health-monitor")

    def deactivate(self) -> None:
        self._active.clear()

    async def check_once(self) -> dict[int, bool]:
        """Check every target engine now. Returns index -> healthy."""
        targets = self._targets()
        results = await asyncio.gather(*(self._check(i) for i in targets))
        self.checks += 1
        return dict(zip(targets, results, strict=True))

    async def _run(self) -> None:
        await self._active.wait()
        await asyncio.sleep(self.first_wait)
        while True:
            await self._active.wait()
            await self.check_once()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class EnginePool:
    """Clients, router, retries and recovery for a list of ``EngineActor`` handles.

    ``engines`` are Ray actor handles (``url``, ``restart``, ``health_generate`` remote methods) or any
    objects whose methods have ``.remote(...)`` returning awaitables. Call :meth:`start` inside the
    event loop that will use the pool.
    """

    def __init__(
        self,
        engines: list[Any],
        *,
        fault_tolerance: bool = True,
        weight_version: int = 0,
        client_factory: ClientFactory | None = None,
        request_timeout: float | None = None,
        health_interval: float = 30.0,
        health_timeout: float = 30.0,
        health_first_wait: float = 300.0,
        no_engine_timeout: float = 600.0,
        max_attempts: int | None = None,
        request_fields: dict[str, Any] | None = None,
        unreachable_for_s: float = 180.0,
        retry_interval_s: float = 1.0,
    ) -> None:
        if not engines:
            raise RaygymError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self.fault_tolerance = fault_tolerance
        self.request_fields = dict(request_fields or {})  # added to every /generate (a LoRA run's lora_path)
        self.router = Router(len(engines), weight_version)
        self.urls: list[str] = [""] * len(engines)
        self.clients: list[Any] = [None] * len(engines)
        self._make_client = client_factory or default_client_factory(request_timeout)
        self.no_engine_timeout = no_engine_timeout
        self.unreachable_for_s = unreachable_for_s  # an engine actor unreachable this long is lost
        self.retry_interval_s = retry_interval_s  # between restart attempts
        self.max_attempts = max_attempts or 2 * len(engines) + 2
        self._changed = asyncio.Event()  # set whenever an engine's state changes
        self._recoveries: dict[int, asyncio.Task[None]] = {}
        self.failures: list[dict[str, Any]] = []  # one entry per detected engine failure
        self.incarnation = [0] * len(engines)  # bumped on every restart: stale failure reports are ignored
        self._last_success = [0.0] * len(engines)  # monotonic time of each engine's last good answer
        self.retries = 0  # requests re-sent after an engine failure or abort, a malformed answer, or a move
        self.malformed = 0  # answers whose body did not fit the protocol or had the wrong number of outputs
        self.moved = 0  # requests cancelled in flight on an engine that left rotation and sent elsewhere
        # per engine: set when it leaves rotation (its requests in flight move elsewhere); a new one once it is back
        self._left = [asyncio.Event() for _ in engines]
        # generation requests (prompt rows: a batched request of k prompts counts k) sent to each engine
        self.routed_rows = [0] * len(engines)
        self.busy_checks = 0  # health probes that timed out on a busy but responsive engine
        self.health_timeout = health_timeout
        self.monitor = HealthMonitor(self.check_engine, self.router.healthy,
                                     interval=health_interval, first_wait=health_first_wait)

    async def start(self) -> None:
        urls = await asyncio.gather(*(e.url.remote() for e in self.engines))
        for i, url in enumerate(urls):
            self._set_url(i, url)

    def _set_url(self, i: int, url: str) -> None:
        self.urls[i] = url
        self.clients[i] = self._make_client(url)

    async def check_engine(self, i: int) -> bool:
        """Probe engine ``i``'s ``/health_generate`` within ``health_timeout``; report it if it failed.

        A loaded engine may answer late (the probe queues behind the batch it is generating), so
        a probe that timed out counts as a failure only if the engine also finished no real request
        meanwhile and, when it has requests in flight, its plain ``/health`` does not answer either
        (busy, not dead). A refused connection (process gone) fails at once."""
        incarnation, started = self.incarnation[i], time.monotonic()
        client = self.clients[i]
        timed_out = False
        try:
            ok = await asyncio.wait_for(client.health_generate(), self.health_timeout)
            reason = "unhealthy answer"
        except asyncio.TimeoutError:
            ok, timed_out, reason = False, True, f"no answer in {self.health_timeout:.0f}s"
        except Exception as e:  # the probe failing in any way means the engine cannot serve
            ok, reason = False, f"{type(e).__name__}: {e}"
        if ok is not False or self._last_success[i] >= started:
            return True
        if timed_out and self.router.outstanding(i) > 0 and await self._answers_health(client):
            self.busy_checks += 1
            return True
        await self.report_failure(i, f"/health_generate failed ({reason})", incarnation)
        return False

    async def _answers_health(self, client: Any) -> bool:
        try:
            return bool(await asyncio.wait_for(client.health(), min(self.health_timeout, 10.0)))
        except Exception:  # no answer at all: not merely busy
            return False

    def engine_name(self, i: int) -> str:
        return f"engine {i} ({self.urls[i]})"

    # --- requests -------------------------------------------------------------------------------

    async def _acquire(self, exclude: set[int]) -> int:
        deadline = time.monotonic() + self.no_engine_timeout
        while True:
            try:
                return self.router.acquire(exclude=exclude)
            except NoHealthyEngineError:
                if exclude and self.router.healthy():
                    exclude = set()  # only the excluded engines are left: allow them again
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoHealthyEngineError(
                        f"no healthy rollout engine for {self.no_engine_timeout:.0f}s; engines needing "
                        f"weights {self.router.needing_weights()} (a verified sync must reach them: apply_sync), "
                        f"dead {[i for i in range(self.router.num_engines) if self.router.state(i) == DEAD]}, "
                        f"lost {[i for i in range(self.router.num_engines) if self.router.state(i) == LOST]}"
                    ) from None
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass

    async def request(
        self, request: GenerateRequest, trace: dict[str, Any] | None = None, *, keep_aborted: bool = False
    ) -> tuple[int, GenerateResponse | list[GenerateResponse]]:
        """POST ``request`` to ``/generate`` on a routed engine; returns ``(engine index, answer)``.

        With fault tolerance a failed engine's request is retried elsewhere; without it the failure
        raises :class:`RaygymError` naming the engine. A request whose engine leaves rotation while it is in
        flight, and one answered with a malformed body, are sent to another engine (the engine that answered
        malformed is not restarted). A response that finished with ``abort`` (an engine paused or aborted it)
        is re-sent too, unless ``keep_aborted``: then it is returned with its tokens so far (partial rollouts
        continue it)."""
        exclude: set[int] = set()
        if self.request_fields:
            request = request.model_copy(update=self.request_fields)
        last = ""
        for attempt in range(1, self.max_attempts + 1):
            i = await self._acquire(exclude)
            incarnation = self.incarnation[i]
            self.routed_rows[i] += request_rows(request)
            if trace is not None:
                trace.update(engine=i, attempts=attempt, sent=time.time())
            try:
                response = await self._generate_unless_left(i, request)
                problem = None if response is None else answer_count_problem(request, response)
                if problem is not None:
                    raise EngineAnswerError(f"/generate: {problem}")
            except EngineAnswerError as e:
                self._malformed(i, e)
                last = f"a malformed answer ({e})"
                exclude.add(i)
                self.retries += 1
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:
                code = _status_code(e)
                if code is not None and 400 <= code < 500:
                    raise EngineRequestError(f"{self.engine_name(i)} rejected the request: {e}") from e
                if not self.fault_tolerance:
                    raise RaygymError(
                        f"rollout {self.engine_name(i)} failed: {type(e).__name__}: {e}; "
                        "set use_fault_tolerance=True to retry on other engines"
                    ) from e
                await self.report_failure(i, f"request failed ({type(e).__name__}: {e})", incarnation)
                last = f"{type(e).__name__}: {e}"
                exclude.add(i)
                self.retries += 1
                continue
            finally:
                self.router.release(i)
            if response is None:  # the engine left rotation while the request was in flight there
                self.moved += 1
                self.retries += 1
                last = f"it left rotation ({self.router.state(i)})"
                exclude.add(i)
                continue
            self._last_success[i] = time.monotonic()
            responses = response if isinstance(response, list) else [response]
            aborted = any(r.finish_type == "abort" for r in responses)
            if not aborted or keep_aborted:
                return i, response
            if not self.fault_tolerance:
                raise RaygymError(f"rollout {self.engine_name(i)} aborted a request; set use_fault_tolerance=True "
                                  "to retry aborted requests on other engines")
            last = "an aborted answer"
            exclude.add(i)
            self.retries += 1
        raise RaygymError(f"a rollout request failed on {self.max_attempts} attempts; last on {self.engine_name(i)}: "
                          f"{last}")

    async def _generate_unless_left(self, i: int, request: GenerateRequest
                                    ) -> GenerateResponse | list[GenerateResponse] | None:
        """Engine ``i``'s answer to ``request``, or None when ``i`` left rotation first (the request is then
        cancelled: its connection closes, which aborts it on a server that still listens)."""
        left = self._left[i]
        if left.is_set():  # set while it was out of rotation earlier; it is back now (acquire returned it)
            left = self._left[i] = asyncio.Event()
        answer = asyncio.ensure_future(self.clients[i].generate(request))
        leaving = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait((answer, leaving), return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not answer.done():
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
        if answer.cancelled():
            return None
        result: GenerateResponse | list[GenerateResponse] = answer.result()
        return result

    def _malformed(self, i: int, error: Exception) -> None:
        """Engine ``i`` answered, but not in the protocol: that request fails (it is sent elsewhere), the engine
        stays (a transport error or 5xx restarts it; a malformed answer is no sign that the server is broken)."""
        self.malformed += 1
        log.warning("rollout %s gave a malformed answer (%s); sending the request elsewhere", self.engine_name(i),
                    error)
        if not self.fault_tolerance:
            raise RaygymError(f"rollout {self.engine_name(i)} gave a malformed answer: {error}; set "
                              "use_fault_tolerance=True to send it to other engines") from error

    def _left_rotation(self, engines: list[int]) -> None:
        """``engines`` changed state: those out of rotation have their requests in flight moved elsewhere."""
        for i in engines:
            if self.router.state(i) != HEALTHY:
                self._left[i].set()
        self._changed.set()

    async def abort_all(self) -> None:
        """Ask every healthy engine to abort what it is still generating (best effort)."""

        async def abort(i: int) -> None:
            try:
                await self.clients[i].abort_request(abort_all=True)
            except Exception as e:  # the engine may be mid-restart; nothing to abort there
                log.debug("abort on %s failed: %s", self.engine_name(i), e)

        await asyncio.gather(*(abort(i) for i in self.router.healthy()))

    # --- failures and recovery -----------------------------------------------------------------

    async def report_failure(self, i: int, reason: str, incarnation: int | None = None) -> None:
        """Engine ``i`` failed: take it out of rotation and restart it in the background (once).

        ``incarnation``: the engine's restart count when the failing call began; a report about an
        incarnation that was already replaced is ignored."""
        if incarnation is not None and incarnation != self.incarnation[i]:
            return
        if not self.router.mark_unhealthy(i):
            return
        self.failures.append({"engine": i, "url": self.urls[i], "reason": reason, "time": time.time()})
        log.warning("rollout %s failed: %s; restarting it", self.engine_name(i), reason)
        self._left_rotation([i])
        if self.fault_tolerance and i not in self._recoveries:
            self._recoveries[i] = asyncio.create_task(self._recover(i), name=f"raygym-restart-engine-{i}")

    async def _recover(self, i: int, attempts: int = 3) -> None:
        """Restart engine ``i``'s server inside its actor. An actor that cannot be reached is asked again until
        Ray decides (its node may be dying: Ray declares a node dead after missed health checks, ~30 s with
        its defaults), for at most ``unreachable_for_s``. An actor that died, stayed unreachable, or whose
        server failed to start ``attempts`` times leaves the engine ``lost``: the driver replaces the actor."""
        failed, unreachable_since = 0, None
        try:
            while True:
                try:
                    await self.engines[i].restart.remote()
                    self._set_url(i, await self.engines[i].url.remote())
                    self.incarnation[i] += 1
                    break
                except Exception as e:
                    if actor_gone(e):  # its node died: only the driver can place a new actor
                        self.mark_lost(i, f"its actor is gone ({type(e).__name__}); waiting for a replacement")
                        return
                    if actor_unreachable(e):
                        unreachable_since = unreachable_since or time.monotonic()
                        waited = time.monotonic() - unreachable_since
                        if waited >= self.unreachable_for_s:
                            self.mark_lost(i, f"its actor has been unreachable for {waited:.0f} s")
                            return
                    else:
                        failed += 1
                        log.warning("restart of %s failed (attempt %d): %s", self.engine_name(i), failed, e)
                        if failed == attempts:
                            self.mark_lost(i, f"its server failed to restart {attempts} times (last: {e})")
                            return
                    await asyncio.sleep(self.retry_interval_s)
            self.router.mark_restarted(i)  # ready again once the driver's fleet synced it
            self._left_rotation([i])
        finally:
            self._recoveries.pop(i, None)

    def mark_lost(self, i: int, reason: str) -> None:
        """Engine ``i``'s actor is gone (e.g. its node died): no traffic until :meth:`replace_engine`."""
        if self.router.state(i) == LOST:
            return
        self.router.mark_lost(i)
        self.failures.append({"engine": i, "url": self.urls[i], "reason": f"lost: {reason}", "time": time.time()})
        log.warning("rollout %s lost: %s", self.engine_name(i), reason)
        self._left_rotation([i])

    async def replace_engine(self, i: int, handle: Any) -> None:
        """A new, started actor serves engine ``i`` (the driver placed it after its node returned). It gets
        traffic once it holds the current weights (:meth:`mark_engine_synced`)."""
        url = await handle.url.remote()
        old = self.clients[i]
        self.engines[i] = handle
        self._set_url(i, url)
        self.incarnation[i] += 1  # failures reported about the old actor are ignored from now on
        self.router.mark_restarted(i)
        self._left_rotation([i])
        close = getattr(old, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception as e:  # its server is gone with the old node
                log.debug("closing the old client of %s failed: %s", self.engine_name(i), e)

    async def wait_for_recoveries(self) -> None:
        """Wait until every restart started so far has finished."""
        while self._recoveries:
            await asyncio.gather(*list(self._recoveries.values()), return_exceptions=True)

    def engines_needing_weights(self) -> list[int]:
        """Restarted engines that must receive the current weights before they get traffic."""
        return self.router.needing_weights()

    def mark_engine_synced(self, i: int, weight_version: int) -> bool:
        """The driver pushed ``weight_version`` to engine ``i``; it serves again if that is current."""
        ready = self.router.mark_ready(i, weight_version)
        if ready:
            self._changed.set()
        return ready

    def set_weight_version(self, version: int) -> None:
        """The policy version is ``version`` and every engine in rotation holds it (see :meth:`apply_sync`)."""
        self.router.set_weight_version(version)
        self._changed.set()

    def apply_sync(self, version: int, reached: list[int]) -> list[int]:
        """A verified sync put ``version`` on the engines ``reached``: they serve it (restarted ones return), the
        others in rotation leave it, their requests in flight moved elsewhere. Returns the engines that left."""
        left = self.router.apply_sync(version, reached)
        for i in left:
            log.warning("rollout %s missed the sync to weight version %d: no requests until a sync reaches it",
                        self.engine_name(i), version)
        self._left_rotation(left)
        return left

    def hold_back(self, engines: list[int]) -> list[int]:
        """``engines`` missed the sync being published: out of rotation now (see :meth:`apply_sync`)."""
        left = self.router.hold_back(engines)
        self._left_rotation(left)
        return left

    def counts(self) -> dict[str, int]:
        """Running totals: ``failures`` (engines failed or lost), ``retries``, ``malformed`` answers, requests
        ``moved`` off an engine that left rotation."""
        return {"failures": len(self.failures), "retries": self.retries, "malformed": self.malformed,
                "moved": self.moved}

    async def close(self) -> None:
        await self.monitor.stop()
        for task in list(self._recoveries.values()):
            task.cancel()
        await asyncio.gather(*self._recoveries.values(), return_exceptions=True)
        for client in self.clients:
            close = getattr(client, "aclose", None) or getattr(client, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result


def actor_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says a Ray actor could not be reached just now (it may be restarting, or its node
    dying before Ray declared it dead)."""
    try:
        from ray.exceptions import ActorUnavailableError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, ActorUnavailableError)


def actor_gone(exc: BaseException) -> bool:
    """True when ``exc`` says a Ray actor died for good (its process or node is gone), not merely that it
    was unreachable for a moment."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, ActorDiedError)
