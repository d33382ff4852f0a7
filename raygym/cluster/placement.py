"""Where every rank runs, realised on Ray: one placement group with one ``{"GPU": 1}`` bundle per GPU,
a throwaway probe task per bundle to learn its node and GPU id (Ray's bundle order is not the physical
order), then :func:`raygym.cluster.layout.layout_from_slots` over the probed bundles. Ray is imported lazily.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

from raygym.cluster.layout import (
    BundleAssignment,
    BundleRecord,
    GpuSlot,
    NodeInfo,
    colocate_shares,
    describe_requirement,
    layout,
    layout_from_slots,
    role_rows,
    shortfall_message,
    slot_sort_key,
    validate_shares,
)
from raygym.config import Recipe
from raygym.config.allocation import GpuAllocation
from raygym.errors import ConfigError, RaygymError

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# GPU fraction a probe task takes inside its bundle: enough for Ray to hand it the bundle's GPU id,
# small enough to fit next to a colocated trainer + engine pair (0.5 + 0.4).
PROBE_GPU_SHARE = 0.01


# ----------------------------------------------------------------------------------------------
# Ray: placement groups, probing, waiting
# ----------------------------------------------------------------------------------------------


def _where_am_i() -> tuple[str, str, list[int], str]:
    """Probe body: node id, node IP, Ray's GPU ids for this bundle, CUDA_VISIBLE_DEVICES."""
    import ray

    gpus = [int(g) for g in ray.get_gpu_ids()]
    node_id = ray.get_runtime_context().get_node_id()
    return node_id, ray.util.get_node_ip_address(), gpus, os.environ.get("CUDA_VISIBLE_DEVICES", "")


@functools.cache
def _probe_task() -> Any:
    import ray

    # A throwaway task rather than an actor: with max_calls=0 its worker processes are reused by the
    # next probes (Ray's GPU-task default of 1 call would start a fresh process per bundle), and the
    # probe never touches CUDA, so there is no GPU memory to give back.
    return ray.remote(max_calls=0)(_where_am_i)


def cluster_nodes() -> list[NodeInfo]:
    """GPU nodes of the connected Ray cluster (GPU ids 0..n-1 as Ray numbers them)."""
    import ray

    out = []
    for n in ray.nodes():
        gpus = int(n.get("Resources", {}).get("GPU", 0))
        if n.get("Alive") and gpus > 0:
            out.append(NodeInfo(n["NodeID"], n["NodeManagerAddress"], tuple(range(gpus))))
    return out


class Placement:
    """A placement group for one run; create with :func:`allocate`.

    ``ready()`` is the group's ready future; ``wait(timeout)`` blocks (logging what is requested vs
    what the cluster has every ``log_interval`` seconds), then probes and lays out the bundles;
    ``ensure_ready()`` waits up to the configured timeout and raises RaygymError naming the missing
    resources. After that ``actor_bundles``, ``critic_bundles``, ``engine_bundles[i]`` and
    ``assignments`` are available. ``release()`` is idempotent; the object is also a context manager.
    """

    def __init__(
        self,
        alloc: GpuAllocation,
        pg: Any,
        *,
        trainer_share: float,
        engine_share: float,
        timeout: float,
        strategy: str,
        cpus_per_bundle: float,
        log_interval: float,
    ) -> None:
        self.alloc = alloc
        self.placement_group = pg
        self.trainer_share = trainer_share
        self.engine_share = engine_share
        self.timeout = timeout
        self.strategy = strategy
        self.cpus_per_bundle = cpus_per_bundle
        self.log_interval = log_interval
        self.created_at = time.monotonic()
        self._released = False
        self._assignments: list[BundleAssignment] | None = None
        self._records: dict[int, BundleRecord] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def ready(self) -> Any:
        """The placement group's ready ObjectRef (resolves when every bundle is reserved)."""
        return self.placement_group.ready()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None = forever) for the bundles; True once ready and probed."""
        import ray

        if self._assignments is not None:
            return True
        if self._released:
            raise RaygymError("placement was released; call allocate() again")
        start = time.monotonic()
        ref = self.ready()
        while True:
            remaining = None if timeout is None else timeout - (time.monotonic() - start)
            step = self.log_interval if remaining is None else max(0.0, min(self.log_interval, remaining))
            done, _ = ray.wait([ref], timeout=step)  # looks at least once, even with no time left
            if done:
                break
            if timeout is not None and time.monotonic() - start >= timeout:
                return False
            logger.warning(
                "placement: waiting %.0f s — %s", time.monotonic() - self.created_at, self._shortfall()
            )
        try:
            self._probe_and_lay_out()
        except BaseException:
            self.release()
            raise
        return True

    def ensure_ready(self) -> Placement:
        """Wait up to the configured timeout; on timeout release the group and raise RaygymError."""
        remaining = self.timeout - (time.monotonic() - self.created_at)
        if not self.wait(max(remaining, 0.0)):
            msg = f"placement not ready after {self.timeout:g} s: {self._shortfall()}"
            self.release()
            raise RaygymError(msg)
        return self

    def release(self) -> None:
        """Remove the placement group (idempotent); actors inside it are killed by Ray."""
        if self._released:
            return
        self._released = True
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            try:
                remove_placement_group(self.placement_group)
            except Exception as exc:  # the cluster may already be gone at interpreter exit
                logger.debug("remove_placement_group failed: %s", exc)

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- results --------------------------------------------------------------------------------
    @property
    def assignments(self) -> list[BundleAssignment]:
        """Every (role, rank) → GPU row, bundle indices being this group's real bundle indices."""
        if self._assignments is None:
            raise RaygymError("placement is not ready yet: call placement.ensure_ready() (or wait()) first")
        return self._assignments

    @property
    def bundles(self) -> list[BundleRecord]:
        """All bundles sorted by (node IP, node, GPU id)."""
        self.assignments  # noqa: B018 - raises when not ready
        return sorted(
            self._records.values(),
            key=lambda b: slot_sort_key(GpuSlot(b.node_id, b.node_ip, b.gpu_id, b.bundle_index)),
        )

    def role_bundles(self, role: str) -> list[BundleRecord]:
        """Bundles of ``role`` ("actor" | "critic" | "rollout") in rank order, with the role's GPU share."""
        return [self._record_for(a) for a in role_rows(self.assignments, role)]

    @property
    def actor_bundles(self) -> list[BundleRecord]:
        return self.role_bundles("actor")

    @property
    def critic_bundles(self) -> list[BundleRecord]:
        return self.role_bundles("critic")

    @property
    def engine_bundles(self) -> list[list[BundleRecord]]:
        """One list per engine: its GPUs' bundles, all on one node, first one hosts the engine actor."""
        engines: dict[int, list[BundleRecord]] = {}
        for a in role_rows(self.assignments, "rollout"):
            engines.setdefault(a.engine_index or 0, []).append(self._record_for(a))
        return [engines[i] for i in sorted(engines)]

    def _record_for(self, a: BundleAssignment) -> BundleRecord:
        b = self._records[a.bundle_index]
        return BundleRecord(b.placement_group, b.bundle_index, b.node_id, b.node_ip, b.gpu_id, a.gpu_share)

    # -- internals ------------------------------------------------------------------------------
    def _shortfall(self) -> str:
        import ray

        counts = [len(n.gpu_ids) for n in cluster_nodes()]
        avail = ray.available_resources()
        cpus = self.cpus_per_bundle * self.alloc.total_gpus
        return shortfall_message(
            self.alloc,
            counts,
            avail.get("GPU", 0.0),
            strategy=self.strategy,
            cpus_needed=cpus,
            cpus_free=avail.get("CPU", 0.0),
        )

    def engine_bundles_now(self, engine: int) -> list[BundleRecord] | None:
        """Engine ``engine``'s bundles where they are placed now, probed again, or None while any of them
        waits for a node. When a node dies Ray re-places its bundles once a node with the resources joins
        (the same machine back, or another); an engine replacing the lost one goes there."""
        import ray
        from ray.util.placement_group import placement_group_table

        rows = [a for a in role_rows(self.assignments, "rollout") if a.engine_index == engine]
        if not rows:
            raise RaygymError(f"placement has no rollout engine {engine}")
        placed = placement_group_table(self.placement_group).get("bundles_to_node_id") or {}
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if any(placed.get(a.bundle_index) not in alive for a in rows):
            return None
        for slot in self._probe([a.bundle_index for a in rows]):
            self._records[slot.bundle_index] = BundleRecord(
                self.placement_group, slot.bundle_index, slot.node_id, slot.ip, slot.gpu_id, 1.0)
        return [self._record_for(a) for a in rows]

    def _probe(self, bundle_indexes: list[int]) -> list[GpuSlot]:
        """Node and GPU id of each bundle, asked by a probe task inside it."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = _probe_task()
        refs = [
            probe.options(
                num_cpus=0,
                num_gpus=PROBE_GPU_SHARE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in bundle_indexes
        ]
        found = ray.get(refs, timeout=max(60.0, self.timeout))
        slots = []
        for i, (node_id, ip, gpus, cvd) in zip(bundle_indexes, found, strict=True):
            gpu = gpus[0] if gpus else int(cvd.split(",")[0])
            slots.append(GpuSlot(node_id, ip, gpu, i))
        return slots

    def _probe_and_lay_out(self) -> None:
        slots = self._probe(list(range(self.alloc.total_gpus)))
        self._assignments = layout_from_slots(
            self.alloc, slots, trainer_share=self.trainer_share, engine_share=self.engine_share
        )
        self._records = {
            s.bundle_index: BundleRecord(self.placement_group, s.bundle_index, s.node_id, s.ip, s.gpu_id, 1.0)
            for s in slots
        }


def allocate(
    alloc: GpuAllocation,
    *,
    trainer_share: float | None = None,
    engine_share: float | None = None,
    timeout: float = 600.0,
    strategy: str = "PACK",
    cpus_per_bundle: float = 0.0,
    log_interval: float = 5.0,
    name: str = "",
) -> Placement:
    """Request one placement group of ``alloc.total_gpus`` bundles ``{"GPU": 1[, "CPU": c]}``; returns at once.

    ``cpus_per_bundle`` defaults to 0 so that GPU bundles never compete with the driver's CPU actors
    (actors placed in the bundles request ``num_cpus=0``). Call ``ensure_ready()`` on the result.

    Shares left None take the Recipe's defaults (:func:`raygym.cluster.layout.colocate_shares`).

    >>> p = allocate(alloc, timeout=60).ensure_ready()              # doctest: +SKIP
    >>> p.actor_bundles[0].node_ip, p.engine_bundles[0][0].gpu_id  # doctest: +SKIP
    """
    trainer_share, engine_share = colocate_shares(trainer_share, engine_share)
    validate_shares(trainer_share, engine_share)
    if strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r}: must be one of {', '.join(PLACEMENT_STRATEGIES)}; PACK is the default"
        )
    if not timeout > 0:
        raise ConfigError(f"placement_timeout={timeout!r}: must be > 0 seconds; e.g. --placement-timeout 600")
    if cpus_per_bundle < 0:
        raise ConfigError(f"cpus_per_bundle={cpus_per_bundle!r}: must be >= 0")
    import ray
    from ray.util.placement_group import placement_group

    if not ray.is_initialized():
        raise RaygymError("allocate() needs a connected Ray: call ray.init(address=...) first")
    bundle: dict[str, float] = {"GPU": 1.0}
    if cpus_per_bundle:
        bundle["CPU"] = float(cpus_per_bundle)
    pg = placement_group([dict(bundle) for _ in range(alloc.total_gpus)], strategy=strategy, name=name)
    logger.info(
        "placement: requested %s as %d bundles %s (%s)",
        describe_requirement(alloc),
        alloc.total_gpus,
        bundle,
        strategy,
    )
    return Placement(
        alloc,
        pg,
        trainer_share=trainer_share,
        engine_share=engine_share,
        timeout=timeout,
        strategy=strategy,
        cpus_per_bundle=cpus_per_bundle,
        log_interval=log_interval,
    )


def allocate_for_recipe(recipe: Recipe, **overrides: Any) -> Placement:
    """:func:`allocate` with the recipe's allocation, colocate shares and ``placement_timeout``."""
    kwargs: dict[str, Any] = {
        "trainer_share": recipe.colocate_trainer_gpu_share,
        "engine_share": recipe.colocate_engine_gpu_share,
        "timeout": recipe.placement_timeout,
    }
    kwargs.update(overrides)
    return allocate(recipe.gpu_allocation(), **kwargs)


def dashboard_nodes(url: str) -> list[NodeInfo]:
    """GPU nodes of the cluster whose dashboard is at ``url`` (Ray's state API over HTTP: works from any
    machine that reaches the dashboard, like ``ray job submit``; no Ray node needed here)."""
    from ray.util.state import list_nodes

    out = []
    for n in list_nodes(address=url, detail=True, limit=10000):
        gpus = int((n.resources_total or {}).get("GPU", 0))
        if n.state == "ALIVE" and gpus > 0:
            out.append(NodeInfo(n.node_id, n.node_ip, tuple(range(gpus))))
    return out


def plan_on_cluster(recipe: Recipe, address: str) -> list[BundleAssignment]:
    """Lay the recipe out on the GPU nodes of the Ray cluster at ``address`` (no job started): a dashboard
    URL (``http://head:8265``, what job submission uses) is asked over HTTP; a GCS address (``head:6379``,
    ``auto``) is joined with ``ray.init`` (this machine must then be a node of that cluster).

    Reuses an already connected Ray. Raises RaygymError naming the shortfall when the cluster is too
    small and ConfigError when an engine would span nodes.
    """
    import ray

    if address.startswith(("http://", "https://")):
        nodes = dashboard_nodes(address)
    else:
        owns = not ray.is_initialized()
        if owns:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            nodes = cluster_nodes()
        finally:
            if owns:
                ray.shutdown()
    return layout(
        recipe.gpu_allocation(),
        nodes,
        trainer_share=recipe.colocate_trainer_gpu_share,
        engine_share=recipe.colocate_engine_gpu_share,
    )
