"""The HTTP side of ``raygym serve``: a Starlette app over an :class:`~raygym.serve.front.OpenAIFront`.

Plain Starlette routes, not FastAPI's: the body is parsed by the front's own pydantic models either way, and
FastAPI's per-request dependency solving and extra middlewares were a measured share of the one-box
server's time per request (``raygym/bench/serve.py``).

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
and an unauthenticated ``GET /health`` (for load balancers; it says nothing about the model).

Every other request needs ``Authorization: Bearer <key>``. The app holds only the SHA-256 digest of the
key (:func:`key_digest`), never the key, and compares digests in constant time; a request without a
valid key gets 401 before its body is read. Errors are OpenAI-shaped (``{"error": {...}}``), including
malformed JSON, bad fields (400, ``param`` names the field), unknown routes (404) and engine failures.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

import pydantic

from raygym.serve.front import OpenAIError, OpenAIFront, engine_error
from raygym.serve.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter

log = logging.getLogger(__name__)

UNAUTHENTICATED_PATHS = frozenset({"/health"})


def key_digest(key: str) -> str:
    """Hex SHA-256 of an API key: what the serving processes hold instead of the key.

    >>> key_digest("k")[:12]
    '8254c329a928'
    """
    return hashlib.sha256(key.encode()).hexdigest()


def authorized(header: str | None, digest: str) -> bool:
    """True when ``header`` is ``Bearer <key>`` for the key of ``digest`` (constant-time compare).

    >>> authorized("Bearer k", key_digest("k")), authorized("Bearer x", key_digest("k")), authorized(None, "")
    (True, False, False)
    """
    if not header or not digest:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(key_digest(token.strip()), digest)


def validation_error(exc: pydantic.ValidationError) -> OpenAIError:
    """A pydantic ValidationError as OpenAI's 400 (``param`` = the offending field)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, str(exc))
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedParameter):
        return OpenAIError(400, str(cause), param=cause.param)
    where = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-after"))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        return OpenAIError(400, f"you must provide a {where} parameter", param=where or None)
    return OpenAIError(400, f"{where}: {message}" if where else message, param=where or None)


def error_response(err: OpenAIError) -> Any:
    """``err`` as OpenAI's JSON error answer (401s name the scheme the key goes in)."""
    from starlette.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class RequireKey:
    """ASGI middleware: every HTTP request but :data:`UNAUTHENTICATED_PATHS` carries the key, checked before its
    body is read. A plain ASGI callable, not Starlette's ``BaseHTTPMiddleware`` (which passes every answer
    through a stream of its own: measured here as a seventh of a replica's time per request)."""

    def __init__(self, app: Any, api_key_digest: str) -> None:
        self.app, self.digest = app, api_key_digest

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            from starlette.datastructures import Headers

            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):  # under a route prefix: the path inside the app
                path = path[len(root):]
            if path not in UNAUTHENTICATED_PATHS:
                header = Headers(scope=scope).get("authorization")
                if not authorized(header, self.digest):
                    message = ("Incorrect API key provided." if header else
                               "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
                    await error_response(OpenAIError(401, message, code="invalid_api_key"))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_http_app(front: OpenAIFront, api_key_digest: str) -> Any:
    """The ASGI app of one front (a Serve replica's, or the one-box server's)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def json_body(model: Any) -> Response:  # pydantic writes the JSON itself (no dict in between)
        return Response(content=model.model_dump_json(), media_type="application/json")

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        text = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) else str(exc.detail)
        return error_response(OpenAIError(exc.status_code, text))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("raygym serve: %s %s failed", request.method, request.url.path)
        return error_response(OpenAIError(500, "internal server error", type="server_error"))

    async def parse(request: Request, model: Any) -> Any:
        try:
            body = json.loads(await request.body() or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise OpenAIError(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error(exc) from None

    async def run(coro: Any) -> Any:
        try:
            return await coro
        except OpenAIError:
            raise
        except Exception as exc:
            err = engine_error(exc)
            if err.status >= 500:
                log.warning("raygym serve: engine call failed: %s", exc)
            raise err from None

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return json_body(front.models())

    async def model(request: Request) -> Response:
        return json_body(front.model(request.path_params["model_id"]))

    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        if req.stream:
            return StreamingResponse(await run(front.stream_completion(req)), media_type="text/event-stream")
        generation = await run(front.complete(req))
        return json_body(front.completion_body(req, generation))

    async def chat_completions(request: Request) -> Response:
        req = await parse(request, ChatCompletionRequest)
        if req.stream:
            return StreamingResponse(await run(front.stream_chat(req)), media_type="text/event-stream")
        generation = await run(front.chat(req))
        return json_body(front.chat_body(req, generation))

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(RequireKey, api_key_digest=api_key_digest)],
                     exception_handlers={OpenAIError: on_openai_error, StarletteHTTPException: on_http_error,
                                         Exception: on_unexpected})


__all__ = ["RequireKey", "authorized", "build_http_app", "engine_error", "error_response", "key_digest",
           "validation_error"]
