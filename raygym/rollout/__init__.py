"""Rollout side: inference servers, the actors that own them, routing and rollout management.

Heavy modules (torch, aiohttp, httpx) load on first use, so ``import raygym.rollout`` stays cheap::

    from raygym.rollout import EngineActor, EngineClient
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "EngineActor": "raygym.rollout.engine",
    "EngineClient": "raygym.engine_api.client",
    "EngineHTTPError": "raygym.engine_api.client",
    "EngineConnectionError": "raygym.engine_api.client",
    "DELTA_LOADER": "raygym.rollout.sglang_args",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raygym.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
