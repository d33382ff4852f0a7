"""Offline: the Modal launcher builds the cluster :func:`raygym.cluster.shape.cluster_shape` describes for a
recipe (its head being GPU node 0), and the ranks land on its nodes as they do on the KubeRay / local-harness
cluster (a CPU head): the trainer ranks on one node, the engines on the other, by address."""

from __future__ import annotations

import pytest

pytest.importorskip("modal", reason="modal is not installed (pip install modal); it is not a dev dependency")

from raygym.cluster.shape import ClusterShape, cluster_shape, roles_by_node  # noqa: E402
from raygym.launchers import bootstrap  # noqa: E402
from raygym.launchers.modal_app import build_app, plan_launch  # noqa: E402
from raygym.launchers.ray_job import resolve_recipe  # noqa: E402

ARGS = ["--preset", "qwen3-30b-a3b"]
CONTAINERS = ("fd00::2", "fd00::3")  # Modal's addresses are IPv6


def modal_shape(args: list[str], container_ips: tuple[str, ...]) -> ClusterShape:
    """The nodes Modal's containers start: each rank's `ray start` line, as the launcher runs it."""
    launch = plan_launch(args)
    assert len(container_ips) == launch.total_nodes
    specs = [bootstrap.ClusterSpec(rank, container_ips, launch.gpus_per_node) for rank in range(launch.total_nodes)]
    commands = [bootstrap.head_command(s) if s.is_head else bootstrap.worker_command(s) for s in specs]
    gpus = [int(cmd[cmd.index("--num-gpus") + 1]) for cmd in commands]
    return ClusterShape(gpus[0], tuple(gpus[1:]))


def test_modal_builds_the_recipes_cluster_with_a_gpu_head() -> None:
    recipe = resolve_recipe(ARGS)
    shape = modal_shape(ARGS, CONTAINERS)
    assert shape == cluster_shape(recipe, gpu_head=True) == ClusterShape(8, (8,))
    info = build_app(ARGS).train_fn.info()
    assert info.cluster_info.size == shape.gpu_nodes and info.gpus == [("H100", 8)]
    # the same GPUs as the KubeRay manifest and the harness, one node fewer (no CPU-only head)
    kuberay = cluster_shape(recipe)
    assert kuberay.total_gpus == shape.total_gpus and kuberay.worker_gpus == (8, 8)


def test_ranks_land_alike_on_modal_and_on_a_cpu_head_cluster() -> None:
    recipe = resolve_recipe(ARGS)
    on_modal = roles_by_node(recipe, list(CONTAINERS), cluster_shape(recipe, gpu_head=True))
    kuberay = cluster_shape(recipe)
    on_kuberay = roles_by_node(recipe, kuberay.node_ips("10.0.0"), kuberay)
    assert on_modal == {"fd00::2": [f"actor {r}" for r in range(8)], "fd00::3": ["engine 0", "engine 1"]}
    assert sorted(on_modal.values()) == sorted(v for v in on_kuberay.values() if v)
    assert on_kuberay["10.0.0.10"] == []  # the CPU head runs the driver and the rollout manager only
