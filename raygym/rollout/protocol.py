"""The engine protocol, under its former name: it lives in :mod:`raygym.engine_protocol` (below ``raygym.rollout``
and ``raygym.weightsync``, which both speak it); new code imports it from there."""

from __future__ import annotations

from raygym.engine_protocol import *  # noqa: F403
from raygym.engine_protocol import __all__  # noqa: F401
