"""Actor groups on local Ray: torchrun env contract, a real gloo all-reduce, call helpers, shutdown."""

from __future__ import annotations

import os
import sys
import time

import pytest
from ray import cloudpickle as ray_cloudpickle

from raygym.cluster.actor_group import (
    ActorGroup,
    call_all,
    call_rank0,
    scatter_gather,
    shutdown_group,
    start_trainer_group,
    submit_all,
)
from raygym.cluster.placement import allocate
from raygym.config.allocation import compute_allocation
from raygym.errors import ConfigError, RaygymError

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module by name: ship its actor classes by value.
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 4


class GlooRank:
    """A trainer-shaped actor: joins a gloo group from the torchrun env and all-reduces its rank."""

    def __init__(self, tag: str) -> None:
        # The torchrun variables must already be in place when the constructor runs.
        self.tag = tag
        self.rank_at_init = int(os.environ["RANK"])
        self.closed = False

    def env(self) -> dict:
        import ray

        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        return {
            **{k: os.environ[k] for k in keys},
            "RAYGYM_TEST_FLAG": os.environ.get("RAYGYM_TEST_FLAG"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "rank_at_init": self.rank_at_init,
            "tag": self.tag,
        }

    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=60)
        )
        try:
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return float(t.item())
        finally:
            dist.destroy_process_group()

    def label(self, items: list[int]) -> list[tuple[int, int]]:
        return [(x, self.rank_at_init) for x in items]

    def wrong_length(self, items: list[int]) -> list[int]:
        return items + [0]

    def close(self) -> bool:
        self.closed = True
        return True


@pytest.fixture(scope="module")
def placement(ray_local):
    alloc = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=WORLD, colocate=True)
    with allocate(alloc, timeout=60).ensure_ready() as p:
        yield p


@pytest.fixture(scope="module")
def group(placement):
    g = start_trainer_group(
        placement,
        GlooRank,
        args=("trainer",),
        environment={"RAYGYM_TEST_FLAG": "on"},
        train_env_vars='{"OMP_NUM_THREADS": 1}',
    )
    yield g
    g.kill()


def test_each_rank_sees_the_torchrun_contract(group: ActorGroup, placement) -> None:
    envs = call_all(group, lambda rank: rank.env.remote(), timeout=120)
    assert [e["RANK"] for e in envs] == [str(r) for r in range(WORLD)]
    assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(WORLD)]  # one node
    assert [e["rank_at_init"] for e in envs] == list(range(WORLD))
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {(str(WORLD), str(WORLD))}
    assert {e["MASTER_ADDR"] for e in envs} == {placement.actor_bundles[0].node_ip}
    assert {e["MASTER_PORT"] for e in envs} == {str(group.master_port)}
    assert {(e["RAYGYM_TEST_FLAG"], e["OMP_NUM_THREADS"], e["tag"]) for e in envs} == {("on", "1", "trainer")}
    # CPU-only machine: each actor still holds its bundle's logical GPU.
    assert [e["gpu_ids"] for e in envs] == [[b.gpu_id] for b in placement.actor_bundles]


def test_gloo_all_reduce_of_ranks(group: ActorGroup) -> None:
    assert call_all(group, lambda rank: rank.all_reduce_rank.remote(), timeout=180) == [float(sum(range(WORLD)))] * WORLD


def test_call_helpers(group: ActorGroup) -> None:
    import ray

    assert call_rank0(group, lambda rank: rank.env.remote(), timeout=60)["RANK"] == "0"
    assert [e["RANK"] for e in ray.get(submit_all(group, lambda rank: rank.env.remote()), timeout=60)] == [
        str(r) for r in range(WORLD)
    ]
    items = list(range(10))
    gathered = scatter_gather(group, lambda rank, shard: rank.label.remote(shard), items, timeout=60)
    assert [x for x, _ in gathered] == items
    assert [r for _, r in gathered] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]  # contiguous shards 3,3,2,2
    with pytest.raises(RaygymError, match=r"rank 0 returned 4 results for 3 items"):
        scatter_gather(group, lambda rank, shard: rank.wrong_length.remote(shard), items, timeout=60)


def test_reserved_env_keys_refused_before_any_actor_starts(placement) -> None:
    with pytest.raises(ConfigError, match=r"train_env_vars\['MASTER_PORT'\]"):
        start_trainer_group(placement, GlooRank, args=("x",), train_env_vars={"MASTER_PORT": "1"})
    with pytest.raises(ConfigError, match=r"environment\['CUDA_VISIBLE_DEVICES'\]"):
        start_trainer_group(placement, GlooRank, args=("x",), environment={"CUDA_VISIBLE_DEVICES": "0"})


def test_shutdown_calls_then_kills(placement, group: ActorGroup) -> None:
    import ray

    # A second, short-lived group in the same bundles (colocated share 0.5 + 0.4 leaves room at 0.4).
    extra = ActorGroup.start(GlooRank, placement.actor_bundles[:2], args=("extra",), gpu_share=0.4)
    assert [e["RANK"] for e in call_all(extra, lambda rank: rank.env.remote(), timeout=120)] == ["0", "1"]
    shutdown_group(extra, lambda rank: rank.close.remote(), timeout=30)
    assert extra.killed
    # ray.kill is asynchronous: a call may still slip in before the kill lands, so poll (bounded).
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(extra.handles[0].env.remote(), timeout=60)
            time.sleep(0.2)
    extra.kill()  # idempotent
