"""The engine API key, under its former name: it lives in :mod:`raygym.engine_auth` (below ``raygym.rollout``
and ``raygym.weightsync``, which both send or check it); new code imports it from there."""

from __future__ import annotations

from raygym.engine_auth import (
    ENGINE_API_KEY_ENV,
    auth_headers,
    authorized,
    engine_api_key,
    new_engine_api_key,
    use_engine_api_key,
)

__all__ = [
    "ENGINE_API_KEY_ENV",
    "auth_headers",
    "authorized",
    "engine_api_key",
    "new_engine_api_key",
    "use_engine_api_key",
]
