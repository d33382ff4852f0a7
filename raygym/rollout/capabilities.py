"""The engine kinds' capability table, under its former name: it lives in :mod:`raygym.engine_kinds` (beside
``raygym.rollout`` and ``raygym.weightsync``, which both ask it); new code imports it from there."""

from __future__ import annotations

from raygym.engine_kinds import (
    DIRECT_LOADER,
    ENGINE_KINDS,
    MODEL_LOADER,
    TRANSPORTS,
    EngineCapabilities,
    capabilities,
    check_inflight_update,
    check_lora,
    check_weight_sync,
    payload_modes,
    version_tuple,
    weight_update_session,
)

__all__ = [
    "DIRECT_LOADER",
    "ENGINE_KINDS",
    "MODEL_LOADER",
    "TRANSPORTS",
    "EngineCapabilities",
    "capabilities",
    "check_inflight_update",
    "check_lora",
    "check_weight_sync",
    "payload_modes",
    "version_tuple",
    "weight_update_session",
]
