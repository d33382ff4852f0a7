"""GPU allocation maths: how many GPUs each role gets and how many nodes a run needs.

Pure: imports neither torch nor ray, so `raygym plan` and config validation run anywhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from raygym.errors import ConfigError


@dataclass(frozen=True)
class GpuAllocation:
    """The GPU budget of one run.

    ``rollout_gpus`` counts GPUs serving rollout engines; when ``colocate`` is set they are the
    actor's own GPUs and add nothing to ``total_gpus``.

    >>> a = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=True)
    >>> (a.total_gpus, a.total_nodes, a.rollout_engines)
    (8, 1, 8)
    """

    actor_gpus: int
    critic_gpus: int
    rollout_gpus: int
    total_gpus: int
    total_nodes: int
    gpus_per_node: int
    rollout_num_gpus_per_engine: int
    rollout_engines: int
    colocate: bool


def require_positive_int(field: str, value: object) -> int:
    """Return ``value`` if it is a real positive ``int`` (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{field}={value!r}: must be a positive int (got {type(value).__name__}); "
            f"write it as a whole number, e.g. --{field.replace('_', '-')} 8"
        )
    if value <= 0:
        raise ConfigError(f"{field}={value!r}: must be a positive int; set --{field.replace('_', '-')} to 1 or more")
    return value


def compute_allocation(
    *,
    actor_num_nodes: int,
    actor_num_gpus_per_node: int,
    colocate: bool,
    rollout_num_gpus: int | None = None,
    rollout_num_gpus_per_engine: int = 1,
    use_critic: bool = False,
    critic_num_nodes: int | None = None,
    critic_num_gpus_per_node: int | None = None,
) -> GpuAllocation:
    """Resolve the reference allocation semantics.

    - actor = nodes x GPUs per node; the critic (only with ``use_critic``) defaults to the actor's shape;
    - colocated engines run on the actor's GPUs (``rollout_num_gpus`` may use fewer of them);
    - disaggregated engines get ``rollout_num_gpus`` GPUs of their own, defaulting to the actor count;
    - rollout GPUs are a positive multiple of ``rollout_num_gpus_per_engine``, an engine fits in one
      node, and the total is a whole number of nodes.
    """
    nodes = require_positive_int("actor_num_nodes", actor_num_nodes)
    per_node = require_positive_int("actor_num_gpus_per_node", actor_num_gpus_per_node)
    per_engine = require_positive_int("rollout_num_gpus_per_engine", rollout_num_gpus_per_engine)
    actor_gpus = nodes * per_node

    critic_gpus = 0
    if use_critic:
        c_nodes = nodes if critic_num_nodes is None else require_positive_int("critic_num_nodes", critic_num_nodes)
        c_per_node = (
            per_node
            if critic_num_gpus_per_node is None
            else require_positive_int("critic_num_gpus_per_node", critic_num_gpus_per_node)
        )
        critic_gpus = c_nodes * c_per_node

    if rollout_num_gpus is None:
        rollout_gpus = actor_gpus
        if not colocate:
            warnings.warn(
                f"rollout_num_gpus is unset with colocate=False: giving the rollout engines {actor_gpus} GPUs "
                "of their own (the actor's count); set --rollout-num-gpus to choose",
                stacklevel=2,
            )
    else:
        rollout_gpus = require_positive_int("rollout_num_gpus", rollout_num_gpus)
        if colocate and rollout_gpus > actor_gpus:
            raise ConfigError(
                f"rollout_num_gpus={rollout_gpus}: colocated engines share the actor's {actor_gpus} GPUs and "
                f"cannot use more; lower --rollout-num-gpus to at most {actor_gpus} or pass --no-colocate"
            )

    if per_engine > per_node:
        raise ConfigError(
            f"rollout_num_gpus_per_engine={per_engine}: an engine must fit inside one node of "
            f"{per_node} GPUs (actor_num_gpus_per_node); lower it to at most {per_node}"
        )
    if rollout_gpus < per_engine or rollout_gpus % per_engine:
        raise ConfigError(
            f"rollout_num_gpus={rollout_gpus}: must be a positive multiple of rollout_num_gpus_per_engine="
            f"{per_engine}; set --rollout-num-gpus to a multiple of {per_engine}"
        )
    if not colocate and per_node % per_engine:
        raise ConfigError(
            f"rollout_num_gpus_per_engine={per_engine}: must divide actor_num_gpus_per_node={per_node} so "
            "that no engine spans two nodes; pick a divisor of the GPUs per node"
        )

    total = actor_gpus + critic_gpus + (0 if colocate else rollout_gpus)
    if total % per_node:
        raise ConfigError(
            f"total GPUs {total} (actor {actor_gpus} + critic {critic_gpus} + rollout "
            f"{0 if colocate else rollout_gpus}) is not a whole number of nodes with "
            f"actor_num_gpus_per_node={per_node}; adjust rollout_num_gpus or critic_num_gpus_per_node"
        )
    return GpuAllocation(
        actor_gpus=actor_gpus,
        critic_gpus=critic_gpus,
        rollout_gpus=rollout_gpus,
        total_gpus=total,
        total_nodes=total // per_node,
        gpus_per_node=per_node,
        rollout_num_gpus_per_engine=per_engine,
        rollout_engines=rollout_gpus // per_engine,
        colocate=colocate,
    )
