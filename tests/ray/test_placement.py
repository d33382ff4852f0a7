"""allocate() on real local Ray: one node with 8 logical GPUs, and a simulated 2-node x 8-GPU cluster."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from ray import cloudpickle as ray_cloudpickle

from raygym.cli.main import render_assignments
from raygym.cluster.actor_group import ActorGroup, call_all, start_engine_group, start_trainer_group
from raygym.cluster.layout import BundleRecord
from raygym.cluster.placement import allocate, plan_on_cluster
from raygym.config.allocation import GpuAllocation, compute_allocation
from raygym.errors import RaygymError

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]

# Ray workers cannot import this test module by name: ship its actor classes by value.
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


class WhereAmI:
    """A minimal actor reporting where Ray put it."""

    def __init__(
        self, engine_index: int | None = None, gpu_ids: list[int] | None = None, host: str = ""
    ) -> None:
        self.engine_args = (engine_index, gpu_ids, host)

    def where(self) -> dict:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "rank": os.environ.get("RANK"),
            "engine_args": self.engine_args,
        }


def assert_actors_on_their_bundles(group: ActorGroup) -> list[dict]:
    seen = call_all(group, lambda actor: actor.where.remote(), timeout=120)
    for info, bundle in zip(seen, group.bundles, strict=True):
        assert info["node_id"] == bundle.node_id
        assert info["gpu_ids"] == [bundle.gpu_id]
        assert info["cuda_visible_devices"] == str(bundle.gpu_id)
    return seen


def pg_state(placement) -> str:
    import ray

    return ray.util.placement_group_table(placement.placement_group)["state"]


def test_single_node_colocated_layout_and_release(ray_local) -> None:
    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=4, colocate=True, rollout_num_gpus_per_engine=2
    )
    placement = allocate(alloc, timeout=60)
    assert placement.wait(60)
    try:
        bundles = placement.bundles
        assert len(bundles) == 4 and len({b.gpu_id for b in bundles}) == 4
        assert [b.gpu_id for b in bundles] == sorted(b.gpu_id for b in bundles)
        actor = placement.actor_bundles
        assert [b.gpu_id for b in actor] == [b.gpu_id for b in bundles]
        assert {b.gpu_share for b in actor} == {0.5}
        engines = placement.engine_bundles
        assert [[b.gpu_id for b in e] for e in engines] == [
            [b.gpu_id for b in actor[i : i + 2]] for i in (0, 2)
        ]
        assert {b.gpu_share for e in engines for b in e} == {0.4}

        trainers = start_trainer_group(placement, WhereAmI)
        engine_group = start_engine_group(placement, WhereAmI)
        seen = assert_actors_on_their_bundles(trainers)
        assert [s["rank"] for s in seen] == ["0", "1", "2", "3"]
        for i, info in enumerate(assert_actors_on_their_bundles(engine_group)):
            assert info["engine_args"] == (i, [b.gpu_id for b in engines[i]], engines[i][0].node_ip)
    finally:
        placement.release()
    placement.release()  # idempotent
    assert placement.released and pg_state(placement) == "REMOVED"


def test_infeasible_request_fails_within_timeout_naming_the_shortfall(ray_local, caplog) -> None:
    alloc = compute_allocation(actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True)
    caplog.set_level(logging.WARNING, logger="raygym.cluster.placement")
    start = time.monotonic()
    placement = allocate(alloc, timeout=2.0, log_interval=0.5)
    with pytest.raises(RaygymError) as err:
        placement.ensure_ready()
    elapsed = time.monotonic() - start
    assert "needs 16 GPUs on 2 nodes with 8 each; cluster has 1 node with 8 GPUs" in str(err.value)
    assert "missing 8 GPUs" in str(err.value)
    assert 2.0 <= elapsed < 30.0  # generous: the suite shares 2 cores
    assert any("waiting" in r.getMessage() and "needs 16 GPUs" in r.getMessage() for r in caplog.records)
    assert placement.released and pg_state(placement) == "REMOVED"


@dataclass
class RecipeStub:
    """The part of raygym.Recipe that plan_on_cluster reads (config.py is written elsewhere)."""

    allocation: GpuAllocation
    colocate_trainer_gpu_share: float = 0.5
    colocate_engine_gpu_share: float = 0.4
    placement_timeout: float = 60.0

    def gpu_allocation(self) -> GpuAllocation:
        return self.allocation


def two_node_run() -> dict:
    """Child-process body: a 2-node x 8-GPU Cluster, a plan, a placement, actors; returns what it saw.

    It runs in its own process because a Ray driver talks to one cluster only: the session's local
    Ray (and whatever other tests keep in it) stays untouched.
    """
    import ray
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 2, "num_gpus": 8, "object_store_memory": 128 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        alloc = compute_allocation(
            actor_num_nodes=1,
            actor_num_gpus_per_node=8,
            colocate=False,
            rollout_num_gpus=8,
            rollout_num_gpus_per_engine=2,
        )
        planned = plan_on_cluster(RecipeStub(alloc), cluster.address)  # reuses the connected Ray
        with allocate(alloc, timeout=120).ensure_ready() as placement:
            trainers = start_trainer_group(placement, WhereAmI)
            engines = start_engine_group(placement, WhereAmI)
            out = {
                "nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
                "planned": [asdict(a) for a in planned],
                "table_rows": render_assignments(planned).row_count,
                "bundles": [asdict_bundle(b) for b in placement.bundles],
                "actor_bundles": [asdict_bundle(b) for b in placement.actor_bundles],
                "engine_bundles": [[asdict_bundle(b) for b in e] for e in placement.engine_bundles],
                "trainers_seen": call_all(trainers, lambda actor: actor.where.remote(), timeout=300),
                "engines_seen": call_all(engines, lambda actor: actor.where.remote(), timeout=300),
                "master_addr": trainers.master_addr,
            }
        out["released"] = placement.released
        out["pg_state"] = pg_state(placement)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def asdict_bundle(b: BundleRecord) -> dict:
    return {"bundle_index": b.bundle_index, "node_id": b.node_id, "node_ip": b.node_ip, "gpu_id": b.gpu_id}


def test_two_nodes_actors_land_where_the_layout_says() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, __file__],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])

    assert len(seen["nodes"]) == 2
    assert len(seen["planned"]) == seen["table_rows"] == 16
    assert {p["node_id"] for p in seen["planned"] if p["role"] == "actor"} != {
        p["node_id"] for p in seen["planned"] if p["role"] == "rollout"
    }
    bundles = seen["bundles"]
    assert sorted(b["node_id"] for b in bundles) == sorted(seen["nodes"] * 8)
    assert sorted(b["bundle_index"] for b in bundles) == list(range(16))
    actor, engines = seen["actor_bundles"], seen["engine_bundles"]
    actor_nodes = {b["node_id"] for b in actor}
    rollout_nodes = {b["node_id"] for e in engines for b in e}
    assert len(actor_nodes) == 1 and len(rollout_nodes) == 1 and actor_nodes != rollout_nodes
    assert [b["gpu_id"] for b in actor] == list(range(8))
    assert [[b["gpu_id"] for b in e] for e in engines] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # Every actor runs on the node and GPU of its bundle.
    for info, b in zip(seen["trainers_seen"], actor, strict=True):
        assert (info["node_id"], info["gpu_ids"], info["cuda_visible_devices"]) == (
            b["node_id"],
            [b["gpu_id"]],
            str(b["gpu_id"]),
        )
    assert [info["rank"] for info in seen["trainers_seen"]] == [str(r) for r in range(8)]
    assert seen["master_addr"] == actor[0]["node_ip"]
    for i, (info, e) in enumerate(zip(seen["engines_seen"], engines, strict=True)):
        assert info["node_id"] == e[0]["node_id"] and info["gpu_ids"] == [e[0]["gpu_id"]]
        assert info["engine_args"] == [i, [b["gpu_id"] for b in e], e[0]["node_ip"]]
    assert seen["released"] and seen["pg_state"] == "REMOVED"


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(json.dumps(two_node_run()))
