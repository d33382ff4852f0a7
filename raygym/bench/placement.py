"""Time from allocate() to 16 trainer actors ready on a simulated 2-node x 8-GPU Ray cluster.

Figure: raygym's path — one placement group, probe *tasks* (worker processes reused), torchrun
variables set inside each actor before its __init__. Baseline, measured in the same run on the same
cluster: the straightforward path — probe *actors* (one fresh process per bundle) and a per-rank
``runtime_env`` carrying the torchrun variables. Each prints one JSON line; the last line holds the
ratio. Run: ``raygym bench placement [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ray.actor import ActorHandle

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rgb-", dir="/tmp"))

NODES, GPUS_PER_NODE = 2, 8


class Pinger:
    """The 16 actors: report their rank once the constructor has run."""

    def ping(self) -> str:
        return os.environ["RANK"]


def raygym_path() -> float:
    from raygym.cluster.actor_group import call_all, start_trainer_group
    from raygym.cluster.placement import allocate
    from raygym.config.allocation import compute_allocation

    alloc = compute_allocation(actor_num_nodes=NODES, actor_num_gpus_per_node=GPUS_PER_NODE, colocate=True)
    start = time.perf_counter()
    with allocate(alloc, timeout=300).ensure_ready() as placement:
        group = start_trainer_group(placement, Pinger)
        ranks = call_all(group, lambda actor: actor.ping.remote(), timeout=600)
        elapsed = time.perf_counter() - start
        group.kill()
    assert ranks == [str(r) for r in range(NODES * GPUS_PER_NODE)]
    return elapsed


class _ProbeActor:
    def where(self) -> tuple[str, str, int]:
        import ray

        return (
            ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address(),
            int(ray.get_gpu_ids()[0]),
        )


def baseline_path() -> float:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InBundle

    n = NODES * GPUS_PER_NODE
    start = time.perf_counter()
    pg = placement_group([{"GPU": 1}] * n, strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    probe = ray.remote(_ProbeActor)
    probes = [  # ray types .remote() as a union
        cast("ActorHandle[_ProbeActor]",
             probe.options(num_cpus=0, num_gpus=0.01, scheduling_strategy=InBundle(pg, i)).remote())
        for i in range(n)
    ]
    where: list[tuple[str, str, int]] = ray.get([p.where.remote() for p in probes], timeout=600)
    for p in probes:
        ray.kill(p)
    order = sorted(range(n), key=lambda i: (where[i][1], where[i][0], where[i][2]))
    master = where[order[0]][1]
    pinger = ray.remote(Pinger)
    actors: list[ActorHandle[Pinger]] = []
    for rank, bundle in enumerate(order):
        env = {"RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": master, "MASTER_PORT": "29500"}
        actors.append(
            cast("ActorHandle[Pinger]", pinger.options(
                num_cpus=0,
                num_gpus=0.5,
                scheduling_strategy=InBundle(pg, bundle),
                runtime_env={"env_vars": env},
            ).remote())
        )
    ranks: list[str] = ray.get([a.ping.remote() for a in actors], timeout=600)
    elapsed = time.perf_counter() - start
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    assert ranks == [str(r) for r in range(n)]
    return elapsed


def machine() -> dict:
    return {
        "cores": os.cpu_count(),
        "device": "cpu (logical GPUs)",
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "nodes": NODES,
        "gpus_per_node": GPUS_PER_NODE,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    repeats = parser.parse_args().repeats

    import ray
    from ray.cluster_utils import Cluster

    node_args: dict[str, Any] = {"num_cpus": 2, "num_gpus": GPUS_PER_NODE, "object_store_memory": 128 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        ours: list[float] = []
        base: list[float] = []
        for i in range(repeats):  # alternate the order so a warm worker pool favours neither side
            pair = (raygym_path, baseline_path) if i % 2 == 0 else (baseline_path, raygym_path)
            for fn in pair:
                (ours if fn is raygym_path else base).append(fn())
        for name, runs in (
            ("allocate_to_16_actors_ready_s", ours),
            ("baseline_actor_probes_runtime_env_s", base),
        ):
            print(
                json.dumps(
                    {
                        "figure": name,
                        "seconds": min(runs),
                        "runs": [round(r, 3) for r in runs],
                        "machine": machine(),
                    }
                )
            )
        print(
            json.dumps(
                {
                    "figure": "allocate_to_16_actors_ready_s",
                    "value": round(min(ours), 3),
                    "baseline": round(min(base), 3),
                    "ratio": round(min(ours) / min(base), 3),
                    "machine": machine(),
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
