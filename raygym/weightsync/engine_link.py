"""How the weight-sync sender and coordinator talk to one engine: the endpoints of the engine protocol
(:mod:`raygym.engine_api.protocol`) they use.

Three implementations of one small interface, all synchronous with an explicit timeout per call:
``HttpEngineLink`` (raygym's server, its vLLM adapter or stock SGLang, over HTTP through the one engine
client, :mod:`raygym.engine_api.client`), ``ActorEngineLink`` (a Ray actor that exposes the same methods, e.g. a
receiver in tests and benchmarks) and ``LocalEngineLink`` (an object in this process). Requests are the
protocol's request models; :func:`checked` parses every answer with the route's answer model, and turns
every failure into :class:`raygym.errors.WeightSyncError` naming the engine.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Protocol

from raygym.engine_api.protocol import ROUTES, Endpoint, body_fields, request_body
from raygym.errors import WeightSyncError

log = logging.getLogger(__name__)


class EngineLink(Protocol):
    """The engine endpoints weight sync needs (routes and bodies of SGLang's HTTP API)."""

    name: str

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        """Send ``body`` (the route's request model, None for routes without one) to ``endpoint``; return the
        decoded JSON answer."""
        ...


def checked(link: EngineLink, endpoint: Endpoint, body: Any, timeout: float) -> Any:
    """``link.call``, its answer parsed by the route's answer model (a list for a batched ``/generate``; None for
    routes without one). Raises ``WeightSyncError`` naming the engine when the call fails or the answer says
    ``success: false``."""
    from raygym.engine_api.client import EngineHTTPError, parse_answer

    try:
        answer = link.call(endpoint, request_body(endpoint, body), timeout)
    except WeightSyncError:
        raise
    except EngineHTTPError as exc:
        raise WeightSyncError(f"engine {link.name}: {endpoint.value} answered failure (HTTP {exc.status}): "
                              f"{exc.message()}") from exc
    except Exception as exc:  # transport-level failure: connection refused, timeout, dead actor
        raise WeightSyncError(f"engine {link.name}: {endpoint.value} failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"engine {link.name}: {endpoint.value} answered failure: {answer.get('message', '')}")
    try:
        return parse_answer(endpoint, {"success": True} if answer is None and ROUTES[endpoint].answer else answer)
    except Exception as exc:
        raise WeightSyncError(f"engine {link.name}: {exc}") from exc


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _client(base_url: str) -> Any:
    """The pooled :class:`~raygym.engine_api.client.EngineClient` of ``base_url`` for synchronous calls (one per URL
    and process, on :func:`raygym.engine_api.client.shared_loop`). Building a client costs far more than a pooled
    request, as much as a whole weight transfer of a small model."""
    from raygym.engine_api.client import EngineClient

    with _clients_lock:
        if not _clients:
            atexit.register(close_pooled_clients)
        if base_url not in _clients:
            _clients[base_url] = EngineClient(base_url)
        return _clients[base_url]


def close_pooled_clients() -> None:
    """Close the pooled clients' connections (at exit, so none is left for aiohttp to report unclosed)."""
    from raygym.engine_api.client import shared_loop

    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for client in clients:
        try:
            shared_loop().run(client.aclose(), 5.0)
        except Exception:  # the process is ending; a connection that cannot close is dropped with it
            log.debug("closing the engine client of %s failed", client.base_url, exc_info=True)


class HttpEngineLink:
    """An engine behind SGLang's HTTP API at ``base_url`` (raygym's server, its vLLM adapter or
    ``sglang.launch_server``). Every request carries the run's engine API key (see :mod:`raygym.engine_api.auth`)."""

    def __init__(self, base_url: str, name: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        from raygym.engine_api.client import shared_loop

        client = _client(self.base_url)
        return shared_loop().run(client.send_json(endpoint, body, timeout=timeout), timeout + 5.0)

    def __repr__(self) -> str:
        return f"HttpEngineLink({self.base_url!r})"


class ActorEngineLink:
    """A Ray actor with one method per endpoint (``actor.<method_name(endpoint)>.remote(**fields) -> dict``)."""

    def __init__(self, actor: Any, name: str):
        self.actor = actor
        self.name = name

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        import ray

        return ray.get(getattr(self.actor, method_name(endpoint)).remote(**body_fields(body)), timeout=timeout)


class LocalEngineLink:
    """An object in this process with one method per endpoint (for in-process receivers)."""

    def __init__(self, target: Any, name: str):
        self.target = target
        self.name = name

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        return getattr(self.target, method_name(endpoint))(**body_fields(body))


def method_name(endpoint: Endpoint) -> str:
    """The method an in-process engine exposes for ``endpoint``: the last part of its path.

    >>> method_name(Endpoint.RAYGYM_WEIGHTS_CHECKSUM), method_name(Endpoint.MODEL_INFO)
    ('weights_checksum', 'model_info')
    """
    return endpoint.value.strip("/").rsplit("/", 1)[-1]


def as_link(engine: Any, index: int) -> EngineLink:
    """A URL string becomes an ``HttpEngineLink``; a link is returned unchanged."""
    if isinstance(engine, str):
        return HttpEngineLink(engine, name=f"engine{index}@{engine}")
    if not hasattr(engine, "call"):
        raise TypeError(f"engine {index}: expected a URL or an EngineLink, got {type(engine).__name__}")
    return engine
