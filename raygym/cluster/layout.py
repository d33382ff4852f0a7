"""Where every rank runs, as pure layout (no Ray): from a :class:`~raygym.config.allocation.GpuAllocation` and
the cluster's GPUs, decide which GPU serves which role and rank. Trainer ranks follow (node IP, GPU id)
order, IPs compared numerically; a rollout engine's GPUs are contiguous on ONE node; colocated engines
share exactly the GPUs of the trainer ranks they serve; disaggregated roles never share a GPU.
:mod:`raygym.cluster.placement` realises a layout on Ray placement groups.

>>> from raygym.config.allocation import compute_allocation
>>> alloc = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=2, colocate=True)
>>> rows = layout(alloc, [NodeInfo("n1", "10.0.0.1", (0, 1))])
>>> [(r.role, r.rank, r.gpu_id, r.gpu_share) for r in rows]
[('actor', 0, 0, 0.5), ('actor', 1, 1, 0.5), ('rollout', 0, 0, 0.4), ('rollout', 1, 1, 0.4)]
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raygym.config.allocation import GpuAllocation
from raygym.errors import ConfigError, RaygymError

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "rollout")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


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


def colocate_shares(trainer_share: float | None, engine_share: float | None) -> tuple[float, float]:
    """The given GPU shares, the Recipe's defaults for those left None (the defaults live only there).

    >>> colocate_shares(None, 0.3)
    (0.5, 0.3)
    """
    from raygym.config.recipe import Recipe

    fields = Recipe.model_fields
    return (fields["colocate_trainer_gpu_share"].default if trainer_share is None else trainer_share,
            fields["colocate_engine_gpu_share"].default if engine_share is None else engine_share)


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

    >>> from raygym.config.allocation import compute_allocation
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
    trainer_share: float | None = None,
    engine_share: float | None = None,
) -> list[BundleAssignment]:
    """Assign roles to GPU slots (pure). Slots are sorted here; their ``bundle_index`` is kept.

    Order of the sorted slots: actor ranks first, then critic ranks, then (disaggregated) the rollout
    GPUs, which are cut into engines node by node so that no engine spans two nodes. Colocated engine
    ``i`` sits on the GPUs of actor ranks ``i*tp .. i*tp+tp-1``.

    Shares left None take the Recipe's ``colocate_*_gpu_share`` defaults. Raises ConfigError when an
    engine would span nodes, RaygymError when there are too few slots.
    """
    trainer_share, engine_share = colocate_shares(trainer_share, engine_share)
    validate_shares(trainer_share, engine_share)
    ordered = sorted(slots, key=slot_sort_key)
    if len(ordered) < alloc.total_gpus:
        node_counts = Counter(s.node_id for s in ordered)
        raise RaygymError("placement " + shortfall_message(alloc, list(node_counts.values())))
    ordered = ordered[: alloc.total_gpus]
    n_actor, n_critic, tp = alloc.actor_gpus, alloc.critic_gpus, alloc.rollout_num_gpus_per_engine

    def row(
        role: str, rank: int, slot: GpuSlot, share: float, engine: int | None = None, gpus: tuple[int, ...] = ()
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
    trainer_share: float | None = None,
    engine_share: float | None = None,
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
