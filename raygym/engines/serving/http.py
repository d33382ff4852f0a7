"""HTTP plumbing of raygym's server: error bodies, request parsing, the API-key and request-origin checks.

Errors are SGLang's ``{"error": {"message": ...}}`` (HTTP 400, 401, 403, 405, 413, 415, 429, 503); weight
endpoints answer ``{"success": bool, "message": str}`` with 200 or 400.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from raygym.engine_api.auth import authorized
from raygym.engine_api.protocol import Endpoint, request_error, route_methods

log = logging.getLogger("raygym.engines.raygym_server.server")
_BROWSER_SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Any, web.Request], Awaitable[web.StreamResponse]]


class BadRequest(ValueError):
    """A client mistake; answered with HTTP 400 (or ``status``) and this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def result_response(result: dict[str, Any]) -> web.Response:
    """A weight endpoint's ``{"success", "message", ...}``: 200 on success, else 400."""
    return web.json_response(result, status=200 if result.get("success") else 400)


async def read_json(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    """The request's JSON object body (``{}`` when empty and not required)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BadRequest(f"{request.path}: the body is larger than this server accepts ({exc.text})", 413) from None
    if not raw.strip():
        if required:
            raise BadRequest(f"{request.path}: expected a JSON object body")
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise BadRequest(f"{request.path}: the body is not UTF-8 text") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise BadRequest(f"{request.path}: body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: body must be a JSON object, got {type(body).__name__}")
    return body


async def parse(request: web.Request, model: type[M], *, required: bool = True) -> M:
    """Read and validate the body as ``model``; a wrong field is a 400 naming it."""
    body = await read_json(request, required=required)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(request_error(exc, request.path)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def handles_errors(fn: Handler) -> Handler:
    """Turn ValueError (BadRequest included) into SGLang's error body; anything else is logged and a 500."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: web.Request) -> web.StreamResponse:
        try:
            return await fn(self, request)
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        except ValueError as exc:
            return error_response(str(exc))
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("%s failed", request.path)
            return error_response(f"{request.path} failed: {type(exc).__name__}: {exc}", status=500)

    return wrapper


def register_routes(router: web.UrlDispatcher, handlers: dict[Endpoint, Callable[[web.Request],
                                                                        Awaitable[web.StreamResponse]]]) -> None:
    """Serve each endpoint on exactly the methods :func:`raygym.engine_api.protocol.route_methods` lists (stock
    SGLang's, route by route); other methods get a 405 naming the allowed ones (from the guard)."""
    for endpoint, handler in handlers.items():
        for method in sorted(route_methods(endpoint)):
            router.add_route(method, endpoint.value, handler)


def guard_middleware(api_key: str | None, state_changing: frozenset[str]) -> Any:
    """aiohttp middleware: the API key on every route but ``/health*`` (SGLang's rule); on routes that change
    state, no browser cross-site request and no body of a type a web page may send without asking (a page on
    the same host must not be able to drive them); a wrong method is SGLang's 405 as a JSON error."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if api_key and not request.path.startswith(Endpoint.HEALTH.value) and not authorized(
                request.headers.get("Authorization"), api_key):
            return error_response("unauthorized: send the engine's API key as 'Authorization: Bearer <key>'", 401)
        if request.path in state_changing:
            ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            has_body = bool(request.content_length) or request.headers.get("Transfer-Encoding") == "chunked"
            # Bodiless control calls (SGLang's clients send no body to /flush_cache) pass with any type
            # but the three a web page may send cross-site without asking (CORS "simple" requests).
            if ctype in _BROWSER_SIMPLE_TYPES or (has_body and ctype != "application/json"):
                return error_response(f"{request.path}: Content-Type must be application/json, got {ctype!r}", 415)
            if request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site") or "Origin" in request.headers:
                return error_response(f"{request.path}: refused: browser requests cannot change the engine", 403)
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            return error_response(f"{request.path}: method {request.method} not allowed; use {allowed}", 405)

    return guard


async def ping(request: web.Request) -> web.Response:
    """SGLang's ``/ping`` (SageMaker's health check): 200, no body."""
    return web.Response(status=200)


def server_info_body(*, model_path: str, context_length: int, max_running_requests: int, device: str,
                     weight_version: str, running: int) -> dict[str, Any]:
    """``/server_info`` as SGLang shapes it, for what raygym's servers know: ``ServerArgs`` field names
    (``model_path``, ``context_length``, ``max_running_requests``, ``tp_size``, ``dp_size``, ``device``), the
    version, and ``internal_states`` (one entry per data-parallel rank)."""
    from raygym import __version__

    return {
        "model_path": model_path, "tokenizer_path": model_path, "served_model_name": model_path,
        "context_length": context_length, "max_running_requests": max_running_requests,
        "max_total_num_tokens": context_length * max_running_requests, "tp_size": 1, "dp_size": 1, "device": device,
        "version": f"raygym-{__version__}", "weight_version": weight_version,
        "internal_states": [{"num_running_reqs": running, "weight_version": weight_version}],
    }
