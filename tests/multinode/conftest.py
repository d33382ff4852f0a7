"""A Ray cluster of separate nodes on this machine (``scripts/local_cluster.py``) shaped as KubeRay would build it
for the tiny recipe with two engines (:func:`raygym.cluster.shape.cluster_shape`): a CPU head and three worker
nodes of one logical GPU each, every node in its own network namespace. Shared by the tests of a module;
each test starts with every node up. Skipped, with the reason, where this machine cannot make namespaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from raygym.cluster.shape import cluster_shape
from raygym.presets import tiny
from scripts.local_cluster import LocalCluster, remove_stale, unavailable

TWO_ENGINES = tiny().model_copy(update={"rollout_num_gpus": 2})  # the runs' recipe: 3 GPU nodes of 1 GPU


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    why = unavailable()
    if why:
        print(f"multi-node tests skipped: {why}")
        pytest.skip(f"cannot make a multi-node cluster on this machine: {why}")
    remove_stale()
    with LocalCluster.of_shape(cluster_shape(TWO_ENGINES), say=print) as made:
        yield made


@pytest.fixture
def nodes_up(cluster: LocalCluster) -> LocalCluster:
    """The cluster with every node up (a previous test may have left one dead)."""
    cluster.ensure_up()
    return cluster

