"""How the weight-sync sender and coordinator talk to one engine: the SGLang HTTP endpoints they use.

Three implementations of one small interface, all synchronous with an explicit timeout per call:
``HttpEngineLink`` (raygym's server or stock SGLang, over HTTP), ``ActorEngineLink`` (a Ray actor that
exposes the same methods, e.g. a receiver in tests and benchmarks) and ``LocalEngineLink`` (an object
in this process). Every failure becomes :class:`raygym.errors.WeightSyncError` naming the engine.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from raygym.errors import WeightSyncError


class EngineLink(Protocol):
    """The engine endpoints weight sync needs (names and fields of SGLang's HTTP API)."""

    name: str

    def call(self, endpoint: str, payload: dict[str, Any], timeout: float, method: str = "POST") -> Any:
        """Send ``payload`` to ``endpoint`` (e.g. ``"update_weights_from_disk"``); return the JSON answer
        (``method="GET"`` for read-only routes such as ``model_info``)."""
        ...


def checked(link: EngineLink, endpoint: str, payload: dict[str, Any], timeout: float,
            method: str = "POST") -> Any:
    """``link.call`` that raises ``WeightSyncError`` naming the engine when the answer is not a success.

    A JSON object answer is returned as is; a list (``generate`` of a batch) too."""
    try:
        answer = link.call(endpoint, payload, timeout, method)
    except WeightSyncError:
        raise
    except Exception as exc:  # transport-level failure: connection refused, timeout, dead actor
        raise WeightSyncError(f"engine {link.name}: /{endpoint} failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"engine {link.name}: /{endpoint} answered failure: {answer.get('message', '')}")
    return answer if isinstance(answer, (dict, list)) else {}


_client: Any = None
_client_lock = threading.Lock()


# Idle pooled connections are dropped after this many seconds, well before the servers drop them
# (uvicorn, under SGLang: 5 s; aiohttp, raygym's server: 75 s), so a request never races a server
# closing its end. The calls of one sync come milliseconds apart and still share connections.
KEEPALIVE_S = 2.0


def http_client() -> Any:
    """The process's pooled ``httpx.Client`` (thread-safe, keep-alive). Building a client costs ~40 ms
    (its TLS context), as much as a whole weight transfer of a small model; a pooled POST ~2 ms."""
    global _client
    with _client_lock:
        if _client is None:
            import httpx

            limits = httpx.Limits(max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
            _client = httpx.Client(limits=limits)
        return _client


class HttpEngineLink:
    """An engine behind SGLang's HTTP API at ``base_url`` (raygym's server or ``sglang.launch_server``).

    Every request carries the run's engine API key (from the environment, see :mod:`raygym.engine_auth`)."""

    def __init__(self, base_url: str, name: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url

    def call(self, endpoint: str, payload: dict[str, Any], timeout: float, method: str = "POST") -> Any:
        from raygym.engine_auth import auth_headers

        url = f"{self.base_url}/{endpoint.lstrip('/')}"
        if method == "GET":
            resp = http_client().get(url, headers=auth_headers(), timeout=timeout)
        else:
            resp = http_client().post(url, json=payload, headers=auth_headers(), timeout=timeout)
        if resp.status_code >= 400:
            return {"success": False, "message": f"HTTP {resp.status_code}: {resp.text[:500]}"}
        if not resp.content:
            return {"success": True}
        try:
            data = resp.json()
        except ValueError:
            return {"success": True, "message": resp.text[:500]}
        return data if isinstance(data, (dict, list)) else {"success": True, "result": data}

    def __repr__(self) -> str:
        return f"HttpEngineLink({self.base_url!r})"


class ActorEngineLink:
    """A Ray actor with one method per endpoint (``actor.<endpoint>.remote(**payload) -> dict``)."""

    def __init__(self, actor: Any, name: str):
        self.actor = actor
        self.name = name

    def call(self, endpoint: str, payload: dict[str, Any], timeout: float, method: str = "POST") -> Any:
        import ray

        return ray.get(getattr(self.actor, method_name(endpoint)).remote(**payload), timeout=timeout)


class LocalEngineLink:
    """An object in this process with one method per endpoint (for in-process receivers)."""

    def __init__(self, target: Any, name: str):
        self.target = target
        self.name = name

    def call(self, endpoint: str, payload: dict[str, Any], timeout: float, method: str = "POST") -> Any:
        return getattr(self.target, method_name(endpoint))(**payload)


def method_name(endpoint: str) -> str:
    """``"raygym/weights_checksum"`` -> ``"weights_checksum"`` (the method an in-process engine exposes)."""
    return endpoint.strip("/").rsplit("/", 1)[-1]


def as_link(engine: Any, index: int) -> EngineLink:
    """A URL string becomes an ``HttpEngineLink``; a link is returned unchanged."""
    if isinstance(engine, str):
        return HttpEngineLink(engine, name=f"engine{index}@{engine}")
    if not hasattr(engine, "call"):
        raise TypeError(f"engine {index}: expected a URL or an EngineLink, got {type(engine).__name__}")
    return engine
