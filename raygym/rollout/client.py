"""The engine client, under its former name: it lives in :mod:`raygym.engine_client` (below ``raygym.rollout`` and
``raygym.weightsync``, which both use it); new code imports it from there."""

from __future__ import annotations

from raygym.engine_client import *  # noqa: F403
from raygym.engine_client import __all__  # noqa: F401
