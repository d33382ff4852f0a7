"""The cluster a recipe needs is the one every launcher builds: the KubeRay manifests in docs/ and the local
multi-node harness (``scripts/local_cluster.py``, built from :func:`raygym.cluster.shape.cluster_shape`) have a
CPU head and ``total_nodes`` GPU workers; what runs where follows the nodes' addresses. The Modal side is
checked in tests/launcher_modal/test_modal_layout.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from raygym.cluster.shape import ClusterShape, cluster_shape, roles_by_node
from raygym.config import TrainConfig
from raygym.launchers.ray_job import resolve_config
from raygym.presets import PRESETS, qwen3_30b_a3b, tiny

DOCS = Path(__file__).resolve().parents[2] / "docs"
MANIFESTS = ("kuberay-rayjob.yaml", "kuberay-rayjob-multinode.yaml")


def manifest_shape(name: str) -> tuple[ClusterShape, TrainConfig]:
    """The cluster a KubeRay RayJob manifest asks for, and the run its entrypoint starts."""
    job = yaml.safe_load((DOCS / name).read_text())["spec"]
    argv = shlex.split(job["entrypoint"])
    cfg = resolve_config(argv[argv.index("raygym.train") + 1:])
    cluster = job["rayClusterSpec"]
    head_gpus = int(cluster["headGroupSpec"]["rayStartParams"].get("num-gpus", "0"))
    workers: list[int] = []
    for group in cluster["workerGroupSpecs"]:
        gpus = int(group["rayStartParams"]["num-gpus"])
        limit = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == int(limit), f"{name}: Ray is told {gpus} GPUs, the pod gets {limit}"
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        workers += [gpus] * group["replicas"]
    return ClusterShape(head_gpus, tuple(workers)), cfg


@pytest.mark.parametrize("name", MANIFESTS)
def test_kuberay_manifests_build_the_cluster_their_run_needs(name: str) -> None:
    shape, cfg = manifest_shape(name)
    assert shape == cluster_shape(cfg.recipe)  # what the harness builds for the same recipe
    assert shape.total_gpus == cfg.recipe.gpu_allocation().total_gpus


def test_multinode_manifest_resumes_and_shares_its_checkpoints() -> None:
    job = yaml.safe_load((DOCS / "kuberay-rayjob-multinode.yaml").read_text())["spec"]
    _, cfg = manifest_shape("kuberay-rayjob-multinode.yaml")
    assert cfg.recipe.load == cfg.checkpoint_dir  # a resubmitted job resumes from the run's own checkpoints
    assert job["backoffLimit"] >= 1
    mounts = [c["volumeMounts"] for g in (job["rayClusterSpec"]["headGroupSpec"], *job["rayClusterSpec"]
              ["workerGroupSpecs"]) for c in g["template"]["spec"]["containers"]]
    assert all({"name": "checkpoints", "mountPath": "/checkpoints"} in m for m in mounts)
    assert cfg.checkpoint_dir.startswith("/checkpoints/")


def test_the_30b_recipe_trains_on_one_node_and_generates_on_the_other() -> None:
    recipe = qwen3_30b_a3b()
    shape = cluster_shape(recipe)
    assert shape == ClusterShape(0, (8, 8))
    roles = roles_by_node(recipe, shape.node_ips("10.0.0"))
    assert roles == {"10.0.0.10": [], "10.0.0.11": [f"actor {r}" for r in range(8)],
                     "10.0.0.12": ["engine 0", "engine 1"]}


def test_placement_follows_addresses_not_the_order_nodes_joined() -> None:
    recipe = tiny().model_copy(update={"rollout_num_gpus": 2})
    shape = cluster_shape(recipe)
    ips = ["10.0.0.9", "10.0.0.30", "10.0.0.4", "10.0.0.100"]  # head first, workers in joining order
    roles = roles_by_node(recipe, ips, shape)
    assert roles == {"10.0.0.9": [], "10.0.0.4": ["actor 0"], "10.0.0.30": ["engine 0"], "10.0.0.100": ["engine 1"]}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_has_a_whole_cluster(preset: str) -> None:
    recipe = PRESETS[preset]()
    kuberay, modal = cluster_shape(recipe), cluster_shape(recipe, gpu_head=True)
    assert kuberay.gpu_nodes == modal.gpu_nodes == recipe.total_nodes()
    assert kuberay.total_gpus == modal.total_gpus == recipe.gpu_allocation().total_gpus
    assert kuberay.head_gpus == 0 and modal.head_gpus == recipe.actor_num_gpus_per_node
    assert sum(map(len, roles_by_node(recipe, kuberay.node_ips("10.1.2"), kuberay).values())) > 0
