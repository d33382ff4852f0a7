"""Where every rank runs: the pure GPU layout and its realisation on Ray placement groups.

Two halves:

- **Layout (pure, no Ray):** from a :class:`~raygym.allocation.GpuAllocation` and the cluster's GPUs,
  decide which GPU serves which role and rank. Trainer ranks follow (node IP, GPU id) order, IPs
  compared numerically; a rollout engine's GPUs are contiguous on ONE node; colocated engines share
  exactly the GPUs of the trainer ranks they serve; disaggregated roles never share a GPU.
- **allocate() (Ray, imported lazily):** one placement group with one ``{"GPU": 1}`` bundle per GPU,
  a throwaway probe task per bundle to learn its node and GPU id (Ray's bundle order is not the
  physical order), then the layout above over the probed bundles.

>>> from raygym.allocation import compute_allocation
>>> alloc = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=2, colocate=True)
>>> rows = layout(alloc, [NodeInfo("n1", "10.0.0.1", (0, 1))])
>>> [(r.role, r.rank, r.gpu_id, r.gpu_share) for r in rows]
[('actor', 0, 0, 0.5), ('actor', 1, 1, 0.5), ('rollout', 0, 0, 0.4), ('rollout', 1, 1, 0.4)]
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from raygym.allocation import GpuAllocation
from raygym.errors import ConfigError, RaygymError

if TYPE_CHECKING:
    from rich.table import Table

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "rollout")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Defaults of the Recipe fields colocate_trainer_gpu_share / colocate_engine_gpu_share.
DEFAULT_TRAINER_GPU_SHARE = 0.5
DEFAULT_ENGINE_GPU_SHARE = 0.4
# GPU fraction a probe task takes inside its bundle: enough for Ray to hand it the bundle's GPU id,
# small enough to fit next to a colocated trainer + engine pair (0.5 + 0.4).
PROBE_GPU_SHARE = 0.01


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeInfo:
    """One cluster node as the layout sees it: its id, IP and GPU ids."""

    node_id: str
    ip: str
    gpu_ids: tuple[int, ...]


@dataclass(frozen=True)
class GpuSlot:
    """One GPU that a placement bundle holds; ``bundle_index`` is the bundle's index in its group."""

    node_id: str
    ip: str
    gpu_id: int
    bundle_index: int


@dataclass(frozen=True)
class BundleAssignment:
    """Which role and rank one GPU serves.

    ``rank`` counts within the role (trainer ranks of "actor"/"critic"; for "rollout" the GPU's
    position among all rollout GPUs). ``gpu_share`` is the fraction of the GPU the role's Ray actor
    requests. Rollout rows also carry ``engine_index`` and the ids of all GPUs of that engine.
    """

    role: str
    rank: int
    node_id: str
    ip: str
    gpu_id: int
    bundle_index: int
    gpu_share: float
    engine_index: int | None = None
    engine_gpu_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BundleRecord:
    """A probed bundle of a live placement group, ready to schedule an actor into."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    bundle_index: int
    node_id: str
    node_ip: str
    gpu_id: int
    gpu_share: float


class RecipeLike(Protocol):
    """What :func:`plan_on_cluster` and :func:`allocate_for_recipe` read from a ``raygym.Recipe``."""

    colocate_trainer_gpu_share: float
    colocate_engine_gpu_share: float
    placement_timeout: float

    def gpu_allocation(self) -> GpuAllocation: ...


# ----------------------------------------------------------------------------------------------
# Pure layout
# ----------------------------------------------------------------------------------------------


def ip_sort_key(ip: str) -> tuple[int, int | str]:
    """Sort key comparing IPs numerically (10.0.0.9 < 10.0.0.10); hostnames sort last, by text."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (2, ip)
    return (0 if addr.version == 4 else 1, int(addr))


def slot_sort_key(slot: GpuSlot) -> tuple[Any, ...]:
    # node_id breaks IP ties so that simulated nodes sharing one IP never interleave their GPUs.
    return (ip_sort_key(slot.ip), slot.node_id, slot.gpu_id)


def slots_from_nodes(nodes: Sequence[NodeInfo]) -> list[GpuSlot]:
    """All GPUs of ``nodes`` in (IP, node, GPU id) order; bundle index = position in that order."""
    flat = [GpuSlot(n.node_id, n.ip, g, -1) for n in nodes for g in n.gpu_ids]
    ordered = sorted(flat, key=slot_sort_key)
    return [GpuSlot(s.node_id, s.ip, s.gpu_id, i) for i, s in enumerate(ordered)]


def validate_shares(trainer_share: float, engine_share: float) -> None:
    """Colocated shares: each in (0, 1] and together at most one GPU (ConfigError otherwise)."""
    for field, value in (
        ("colocate_trainer_gpu_share", trainer_share),
        ("colocate_engine_gpu_share", engine_share),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(
                f"{field}={value!r}: must be a fraction of one GPU in (0, 1]; e.g. --{field.replace('_', '-')} 0.4"
            )
    if trainer_share + engine_share > 1 + 1e-9:
        raise ConfigError(
            f"colocate_trainer_gpu_share={trainer_share} + colocate_engine_gpu_share={engine_share} = "
            f"{trainer_share + engine_share:g} > 1: colocated trainer and engine share one GPU; lower one so "
            "the sum is at most 1 (defaults 0.5 + 0.4)"
        )


def describe_requirement(alloc: GpuAllocation) -> str:
    """'16 GPUs on 2 nodes with 8 each' — what a run asks of the cluster."""
    nodes = "1 node" if alloc.total_nodes == 1 else f"{alloc.total_nodes} nodes"
    return f"{alloc.total_gpus} GPUs on {nodes} with {alloc.gpus_per_node} each"


def describe_cluster(node_gpu_counts: Sequence[int]) -> str:
    """'1 node with 8 GPUs' or '3 nodes: 2 with 8 GPUs, 1 with 4 GPUs' (GPU-less nodes are left out)."""
    counts = Counter(c for c in node_gpu_counts if c > 0)
    if not counts:
        return "no GPUs"
    if len(counts) == 1:
        ((gpus, n),) = counts.items()
        return f"{n} node{'s' if n > 1 else ''} with {gpus} GPU{'s' if gpus > 1 else ''}"
    total = sum(counts.values())
    parts = ", ".join(
        f"{n} with {g} GPU{'s' if g > 1 else ''}" for g, n in sorted(counts.items(), reverse=True)
    )
    return f"{total} nodes: {parts}"


def shortfall_message(
    alloc: GpuAllocation,
    node_gpu_counts: Sequence[int],
    free_gpus: float | None = None,
    *,
    strategy: str = "PACK",
    cpus_needed: float = 0.0,
    cpus_free: float | None = None,
) -> str:
    """Why a placement cannot be satisfied, naming the missing resources.

    >>> from raygym.allocation import compute_allocation
    >>> a = compute_allocation(actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True)
    >>> shortfall_message(a, [8], 8)
    'needs 16 GPUs on 2 nodes with 8 each; cluster has 1 node with 8 GPUs (8 free); missing 8 GPUs'
    """
    have = sum(node_gpu_counts)
    need = alloc.total_gpus
    free_txt = "" if free_gpus is None else f" ({free_gpus:g} free)"
    msg = f"needs {describe_requirement(alloc)}; cluster has {describe_cluster(node_gpu_counts)}{free_txt}"
    reasons = []
    if have < need:
        reasons.append(f"missing {need - have} GPUs")
    elif free_gpus is not None and free_gpus < need:
        reasons.append(
            f"{need - free_gpus:g} of the GPUs it needs are held by other placement groups or actors"
        )
    if cpus_needed and cpus_free is not None and cpus_free < cpus_needed:
        reasons.append(
            f"missing {cpus_needed - cpus_free:g} free CPUs for the bundles ({cpus_needed:g} requested)"
        )
    if not reasons:
        reasons.append(f"enough GPUs exist but strategy {strategy} cannot place {need} bundles on them")
    return msg + "; " + "; ".join(reasons)


def layout_from_slots(
    alloc: GpuAllocation,
    slots: Sequence[GpuSlot],
    *,
    trainer_share: float = DEFAULT_TRAINER_GPU_SHARE,
    engine_share: float = DEFAULT_ENGINE_GPU_SHARE,
) -> list[BundleAssignment]:
    """Assign roles to GPU slots (pure). Slots are sorted here; their ``bundle_index`` is kept.

    Order of the sorted slots: actor ranks first, then critic ranks, then (disaggregated) the rollout
    GPUs, which are cut into engines node by node so that no engine spans two nodes. Colocated engine
    ``i`` sits on the GPUs of actor ranks ``i*tp .. i*tp+tp-1``.

    Raises ConfigError when an engine would span nodes, RaygymError when there are too few slots.
    """
    validate_shares(trainer_share, engine_share)
    ordered = sorted(slots, key=slot_sort_key)
    if len(ordered) < alloc.total_gpus:
        node_counts = Counter(s.node_id for s in ordered)
        raise RaygymError("placement " + shortfall_message(alloc, list(node_counts.values())))
    ordered = ordered[: alloc.total_gpus]
    n_actor, n_critic, tp = alloc.actor_gpus, alloc.critic_gpus, alloc.rollout_num_gpus_per_engine

    def row(
        role: str, rank: int, slot: GpuSlot, share: float, engine: int | None = None, gpus=()
    ) -> BundleAssignment:
        return BundleAssignment(
            role, rank, slot.node_id, slot.ip, slot.gpu_id, slot.bundle_index, share, engine, gpus
        )

    actor_share = trainer_share if alloc.colocate else 1.0
    out = [row("actor", r, s, actor_share) for r, s in enumerate(ordered[:n_actor])]
    out += [row("critic", r, s, 1.0) for r, s in enumerate(ordered[n_actor : n_actor + n_critic])]

    if alloc.colocate:
        engines = [ordered[e * tp : (e + 1) * tp] for e in range(alloc.rollout_engines)]
        share = engine_share
    else:
        engines = _cut_engines_per_node(ordered[n_actor + n_critic :], tp)
        share = 1.0
    rank = 0
    for e, gpus in enumerate(engines):
        _require_one_node(e, gpus, tp)
        ids = tuple(s.gpu_id for s in gpus)
        for s in gpus:
            out.append(row("rollout", rank, s, share, e, ids))
            rank += 1
    return out


def layout(
    alloc: GpuAllocation,
    nodes: Sequence[NodeInfo],
    *,
    trainer_share: float = DEFAULT_TRAINER_GPU_SHARE,
    engine_share: float = DEFAULT_ENGINE_GPU_SHARE,
) -> list[BundleAssignment]:
    """Layout over whole nodes: the first ``total_gpus`` GPUs in (IP, GPU id) order are used.

    ``bundle_index`` is the GPU's position in that order (what it is after allocate() sorts bundles).
    """
    return layout_from_slots(
        alloc, slots_from_nodes(nodes), trainer_share=trainer_share, engine_share=engine_share
    )


def _cut_engines_per_node(slots: Sequence[GpuSlot], tp: int) -> list[list[GpuSlot]]:
    by_node: dict[str, list[GpuSlot]] = {}
    for s in slots:  # dicts keep first-seen order, i.e. the sorted node order
        by_node.setdefault(s.node_id, []).append(s)
    engines: list[list[GpuSlot]] = []
    for node_slots in by_node.values():
        if len(node_slots) % tp:
            raise ConfigError(
                f"rollout_num_gpus_per_engine={tp}: node {node_slots[0].ip} ({node_slots[0].node_id[:12]}) has "
                f"{len(node_slots)} rollout GPUs, not a multiple of {tp}, so an engine would span two nodes; "
                "each engine must sit on one node — choose a divisor of the GPUs per node"
            )
        engines += [node_slots[i : i + tp] for i in range(0, len(node_slots), tp)]
    return engines


def _require_one_node(engine: int, gpus: Sequence[GpuSlot], tp: int) -> None:
    nodes = sorted({(s.ip, s.node_id) for s in gpus})
    if len(nodes) > 1:
        where = ", ".join(f"{ip} ({nid[:12]})" for ip, nid in nodes)
        raise ConfigError(
            f"rollout_num_gpus_per_engine={tp}: engine {engine} would span nodes {where}; an engine's GPUs "
            "must sit on one node — choose a divisor of the GPUs per node, or nodes with more GPUs"
        )


def role_rows(assignments: Sequence[BundleAssignment], role: str) -> list[BundleAssignment]:
    """The rows of one role in rank order."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {ROLES}")
    return sorted((a for a in assignments if a.role == role), key=lambda a: a.rank)


def render_assignments(assignments: Sequence[BundleAssignment]) -> Table:
    """A rich table (node, IP, GPU, role, rank, engine: its GPUs, share, bundle) for ``raygym plan``."""
    from rich.table import Table

    table = Table(title="raygym placement")
    for col in ("node", "ip", "gpu", "role", "rank", "engine: gpus", "share", "bundle"):
        numeric = col in ("gpu", "rank", "share", "bundle")
        table.add_column(col, justify="right" if numeric else "left", no_wrap=col in ("ip", "role"))
    order = sorted(assignments, key=lambda a: (ip_sort_key(a.ip), a.node_id, a.gpu_id, ROLES.index(a.role)))
    for a in order:
        engine = "" if a.engine_index is None else f"{a.engine_index}: {','.join(map(str, a.engine_gpu_ids))}"
        table.add_row(
            a.node_id[:8],
            a.ip,
            str(a.gpu_id),
            a.role,
            str(a.rank),
            engine,
            f"{a.gpu_share:g}",
            str(a.bundle_index),
        )
    return table


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

    def _probe_and_lay_out(self) -> None:
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
            for i in range(self.alloc.total_gpus)
        ]
        found = ray.get(refs, timeout=max(60.0, self.timeout))
        slots = []
        for i, (node_id, ip, gpus, cvd) in enumerate(found):
            gpu = gpus[0] if gpus else int(cvd.split(",")[0])
            slots.append(GpuSlot(node_id, ip, gpu, i))
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
    trainer_share: float = DEFAULT_TRAINER_GPU_SHARE,
    engine_share: float = DEFAULT_ENGINE_GPU_SHARE,
    timeout: float = 600.0,
    strategy: str = "PACK",
    cpus_per_bundle: float = 0.0,
    log_interval: float = 5.0,
    name: str = "",
) -> Placement:
    """Request one placement group of ``alloc.total_gpus`` bundles ``{"GPU": 1[, "CPU": c]}``; returns at once.

    ``cpus_per_bundle`` defaults to 0 so that GPU bundles never compete with the driver's CPU actors
    (actors placed in the bundles request ``num_cpus=0``). Call ``ensure_ready()`` on the result.

    >>> p = allocate(alloc, timeout=60).ensure_ready()              # doctest: +SKIP
    >>> p.actor_bundles[0].node_ip, p.engine_bundles[0][0].gpu_id  # doctest: +SKIP
    """
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


def allocate_for_recipe(recipe: RecipeLike, **overrides: Any) -> Placement:
    """:func:`allocate` with the recipe's allocation, colocate shares and ``placement_timeout``."""
    kwargs: dict[str, Any] = {
        "trainer_share": recipe.colocate_trainer_gpu_share,
        "engine_share": recipe.colocate_engine_gpu_share,
        "timeout": recipe.placement_timeout,
    }
    kwargs.update(overrides)
    return allocate(recipe.gpu_allocation(), **kwargs)


def plan_on_cluster(recipe: RecipeLike, address: str) -> list[BundleAssignment]:
    """Connect to the Ray cluster at ``address`` and lay the recipe out on its GPU nodes (no job started).

    Reuses an already connected Ray. Raises RaygymError naming the shortfall when the cluster is too
    small and ConfigError when an engine would span nodes.
    """
    import ray

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
