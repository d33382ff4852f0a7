"""The Ray cluster a recipe needs, as every launcher builds it (pure: neither torch nor ray).

A run needs ``recipe.total_nodes()`` GPU nodes of ``actor_num_gpus_per_node`` GPUs each. Launchers differ in
one thing only, where the Ray head sits:

- KubeRay (``docs/kuberay-rayjob*.yaml``) and the local multi-node harness (``scripts/local_cluster.py``):
  a CPU-only head (``num-gpus: 0``) plus one worker per GPU node; the job's driver and the rollout manager
  run on the head, so losing a GPU node never takes them along;
- Modal (``raygym/launchers/modal_app.py``): ``total_nodes`` clustered GPU containers, container 0 being the head,
  so the driver shares a node with trainer or engine ranks.

Either way :func:`raygym.cluster.layout.layout` decides which GPU serves which rank from the nodes' addresses, so
:func:`roles_by_node` says, before any cluster exists, what each node will run.

>>> from raygym.presets import tiny
>>> r = tiny().model_copy(update={"rollout_num_gpus": 2})
>>> shape = cluster_shape(r)
>>> shape.worker_gpus, shape.head_gpus
((1, 1, 1), 0)
>>> roles_by_node(r, shape.node_ips("10.0.0"))
{'10.0.0.10': [], '10.0.0.11': ['actor 0'], '10.0.0.12': ['engine 0'], '10.0.0.13': ['engine 1']}
"""

from __future__ import annotations

from dataclasses import dataclass

from raygym.cluster.layout import NodeInfo, layout
from raygym.config import Recipe

HEAD_HOST = 10  # the harness's and the examples' head address: <subnet>.10, workers .11, .12, ...


@dataclass(frozen=True)
class ClusterShape:
    """The Ray nodes of a run: the head's GPUs and each worker's (rank order)."""

    head_gpus: int
    worker_gpus: tuple[int, ...]

    @property
    def gpu_nodes(self) -> int:
        return len(self.worker_gpus) + (1 if self.head_gpus else 0)

    @property
    def total_gpus(self) -> int:
        return self.head_gpus + sum(self.worker_gpus)

    def node_ips(self, subnet: str) -> list[str]:
        """Addresses as the harness gives them: ``<subnet>.10`` for the head, ``.11``, ``.12``, ... after."""
        return [f"{subnet}.{HEAD_HOST + i}" for i in range(1 + len(self.worker_gpus))]

    def nodes(self, ips: list[str]) -> list[NodeInfo]:
        """The GPU nodes as :func:`raygym.cluster.layout.layout` sees them (a CPU-only head is left out)."""
        gpus = (self.head_gpus, *self.worker_gpus)
        return [NodeInfo(f"node-{i}", ip, tuple(range(g))) for i, (ip, g) in enumerate(zip(ips, gpus, strict=True))
                if g > 0]


def cluster_shape(recipe: Recipe, *, gpu_head: bool = False) -> ClusterShape:
    """The cluster ``recipe`` runs on: ``total_nodes()`` GPU nodes of ``actor_num_gpus_per_node`` GPUs, the
    head CPU-only (KubeRay, the harness) or, with ``gpu_head``, the first GPU node (Modal)."""
    alloc = recipe.gpu_allocation()
    nodes, per_node = alloc.total_nodes, alloc.gpus_per_node
    if gpu_head:
        return ClusterShape(per_node, (per_node,) * (nodes - 1))
    return ClusterShape(0, (per_node,) * nodes)


def roles_by_node(recipe: Recipe, ips: list[str], shape: ClusterShape | None = None) -> dict[str, list[str]]:
    """What each node (by address, head first) runs: ``actor R``, ``critic R``, ``engine E`` (colocated
    engines share their actors' GPUs; an engine of several GPUs is named once)."""
    shape = shape or cluster_shape(recipe)
    rows = layout(recipe.gpu_allocation(), shape.nodes(ips), trainer_share=recipe.colocate_trainer_gpu_share,
                  engine_share=recipe.colocate_engine_gpu_share)
    out: dict[str, list[str]] = {ip: [] for ip in ips}
    for row in rows:
        name = f"engine {row.engine_index}" if row.role == "rollout" else f"{row.role} {row.rank}"
        if name not in out[row.ip]:
            out[row.ip].append(name)
    return out
