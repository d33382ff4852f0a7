"""A new actor for a rollout engine whose actor is gone (its node died), once Ray placed its bundles again.

:class:`EngineSpawner` remembers how the run's engines were started (actor class, arguments, environment,
the run's engine API key) and starts one more the same way in the engine's bundles where they are placed
now (:meth:`raygym.cluster.placement.Placement.engine_bundles_now`). The driver's
:class:`raygym.engines.fleet.EngineFleet` decides when, hands the started actor to the rollout manager and
syncs it before it gets traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raygym.cluster.actor_group import ActorGroup, engine_placement_kwargs, merge_user_env
from raygym.cluster.placement import BundleRecord, Placement

logger = logging.getLogger(__name__)


@dataclass
class EngineSpawner:
    """How the run's engines are started, to start a replacement the same way."""

    placement: Placement
    actor_cls: type
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    environment: Mapping[str, Any] | None
    api_key: str
    spawned: int = field(default=0)  # replacement actors started so far

    def placed(self, engine: int) -> list[BundleRecord] | None:
        """Engine ``engine``'s bundles if every one of them is on a live node now, else None."""
        return self.placement.engine_bundles_now(engine)

    def spawn(self, engine: int, bundles: list[BundleRecord], old: Any = None) -> tuple[Any, Any]:
        """Start a new actor for ``engine`` in ``bundles`` (the old handle, if any, is killed first, so its
        bundle's resources are free); returns (handle, the ObjectRef of its ``start()``: its URL)."""
        import ray

        if old is not None:
            try:
                ray.kill(old, no_restart=True)
            except Exception as exc:  # gone with its node
                logger.debug("killing the old actor of engine %d failed: %s", engine, exc)
        group = ActorGroup.start(self.actor_cls, [bundles[0]], args=self.args, kwargs=self.kwargs,
                                 per_rank_kwargs=[engine_placement_kwargs(engine, bundles)],
                                 user_env=merge_user_env(self.environment), torchrun_env=False)
        handle = group.handles[0]
        # One caller's calls to a (non-threaded) actor run in order: the key is set before start() runs.
        handle.use_engine_api_key.remote(self.api_key)
        self.spawned += 1
        return handle, handle.start.remote()
