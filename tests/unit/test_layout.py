"""Pure layout maths (raygym.cluster.placement) and the pure env / sharding helpers of raygym.cluster.actor_group."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from raygym.cli.main import render_assignments
from raygym.cluster.actor_group import build_rank_envs, merge_user_env, shard_evenly
from raygym.cluster.layout import (
    BundleAssignment,
    GpuSlot,
    NodeInfo,
    describe_cluster,
    ip_sort_key,
    layout,
    layout_from_slots,
    role_rows,
    shortfall_message,
    validate_shares,
)
from raygym.config.allocation import GpuAllocation, compute_allocation
from raygym.errors import ConfigError, RaygymError


def nodes_of(*ips: str, gpus: int = 8) -> list[NodeInfo]:
    return [NodeInfo(f"node-{ip}", ip, tuple(range(gpus))) for ip in ips]


def phys_key(a: BundleAssignment) -> tuple:
    return (ip_sort_key(a.ip), a.node_id, a.gpu_id)


def check_invariants(alloc: GpuAllocation, rows: list[BundleAssignment]) -> None:
    """What every layout must satisfy, whatever the cluster shape."""
    actor, critic, rollout = (role_rows(rows, r) for r in ("actor", "critic", "rollout"))
    assert [a.rank for a in actor] == list(range(alloc.actor_gpus))
    assert [a.rank for a in critic] == list(range(alloc.critic_gpus))
    assert [a.rank for a in rollout] == list(range(alloc.rollout_gpus))
    # Trainer ranks follow the physical (IP, GPU) order.
    for group in (actor, critic):
        keys = [phys_key(a) for a in group]
        assert keys == sorted(keys)
    # No GPU is over-subscribed, and only colocated actor/rollout pairs share one.
    per_gpu: dict[tuple, list[BundleAssignment]] = defaultdict(list)
    for a in rows:
        per_gpu[(a.node_id, a.gpu_id)].append(a)
    for users in per_gpu.values():
        assert sum(u.gpu_share for u in users) <= 1 + 1e-9
        roles = sorted(u.role for u in users)
        assert roles in (["actor"], ["critic"], ["rollout"]) or (
            alloc.colocate and roles == ["actor", "rollout"]
        )
    assert len({a.bundle_index for a in rows}) == alloc.total_gpus
    # Engines: the right size, one node, listed GPUs are the rows' GPUs.
    engines: dict[int, list[BundleAssignment]] = defaultdict(list)
    for a in rollout:
        engines[a.engine_index].append(a)
    assert sorted(engines) == list(range(alloc.rollout_engines))
    for e, members in engines.items():
        assert len(members) == alloc.rollout_num_gpus_per_engine
        assert len({m.node_id for m in members}) == 1, f"engine {e} spans nodes"
        assert all(m.engine_gpu_ids == tuple(x.gpu_id for x in members) for m in members)
        if alloc.colocate:
            tp = alloc.rollout_num_gpus_per_engine
            served = actor[e * tp : (e + 1) * tp]
            assert [(m.node_id, m.gpu_id) for m in members] == [(s.node_id, s.gpu_id) for s in served]


def test_colocated_single_node_of_eight() -> None:
    alloc = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=True)
    rows = layout(alloc, nodes_of("10.0.0.1"))
    check_invariants(alloc, rows)
    actor, rollout = role_rows(rows, "actor"), role_rows(rows, "rollout")
    assert [a.gpu_id for a in actor] == list(range(8))
    assert {a.gpu_share for a in actor} == {0.5} and {a.gpu_share for a in rollout} == {0.4}
    assert [(a.engine_index, a.gpu_id) for a in rollout] == [(i, i) for i in range(8)]


def test_colocated_shares_are_fields_not_constants() -> None:
    alloc = compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=4, colocate=True)
    rows = layout(alloc, nodes_of("10.0.0.1", gpus=4), trainer_share=0.7, engine_share=0.25)
    assert {a.gpu_share for a in role_rows(rows, "actor")} == {0.7}
    assert {a.gpu_share for a in role_rows(rows, "rollout")} == {0.25}


def test_disaggregated_eight_plus_eight_on_two_nodes_given_out_of_order() -> None:
    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=False, rollout_num_gpus=8
    )
    rows = layout(alloc, nodes_of("10.0.0.10", "10.0.0.9"))
    check_invariants(alloc, rows)
    assert {a.ip for a in role_rows(rows, "actor")} == {"10.0.0.9"}  # 9 < 10 numerically
    assert {a.ip for a in role_rows(rows, "rollout")} == {"10.0.0.10"}
    assert {a.gpu_share for a in rows} == {1.0}


def test_critic_gets_its_own_gpus() -> None:
    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=False, rollout_num_gpus=8, use_critic=True
    )
    rows = layout(alloc, nodes_of("192.168.1.3", "192.168.1.1", "192.168.1.2"))
    check_invariants(alloc, rows)
    assert [{a.ip for a in role_rows(rows, r)} for r in ("actor", "critic", "rollout")] == [
        {"192.168.1.1"},
        {"192.168.1.2"},
        {"192.168.1.3"},
    ]


def test_colocated_critic_with_partial_node() -> None:
    alloc = compute_allocation(
        actor_num_nodes=1,
        actor_num_gpus_per_node=4,
        colocate=True,
        use_critic=True,
        critic_num_gpus_per_node=4,
    )
    rows = layout(alloc, nodes_of("10.1.0.2", "10.1.0.1", gpus=4))
    check_invariants(alloc, rows)
    assert {a.ip for a in role_rows(rows, "critic")} == {"10.1.0.2"}
    assert {a.ip for a in role_rows(rows, "rollout")} == {"10.1.0.1"}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_engines_colocated(tp: int) -> None:
    alloc = compute_allocation(
        actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True, rollout_num_gpus_per_engine=tp
    )
    rows = layout(alloc, nodes_of("10.0.0.2", "10.0.0.1"))
    check_invariants(alloc, rows)
    first = [a for a in role_rows(rows, "rollout") if a.engine_index == 1]
    assert [a.gpu_id for a in first] == list(range(tp, 2 * tp)) and {a.ip for a in first} == {"10.0.0.1"}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_engines_disaggregated(tp: int) -> None:
    alloc = compute_allocation(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        colocate=False,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=tp,
    )
    rows = layout(alloc, nodes_of("10.0.0.1", "10.0.0.2"))
    check_invariants(alloc, rows)
    assert alloc.rollout_engines == 8 // tp
    assert {a.engine_gpu_ids for a in role_rows(rows, "rollout")} == {
        tuple(range(i, i + tp)) for i in range(0, 8, tp)
    }


def test_ranks_follow_ip_then_gpu_whatever_the_input_order() -> None:
    alloc = compute_allocation(
        actor_num_nodes=3, actor_num_gpus_per_node=4, colocate=True, rollout_num_gpus_per_engine=2
    )
    nodes = [
        NodeInfo("c", "10.0.0.10", (3, 1, 0, 2)),
        NodeInfo("a", "10.0.0.9", (2, 0, 3, 1)),
        NodeInfo("b", "9.255.0.1", (1, 3, 2, 0)),
    ]
    rows = layout(alloc, nodes)
    check_invariants(alloc, rows)
    got = [(a.ip, a.gpu_id) for a in role_rows(rows, "actor")]
    want = [(ip, g) for ip in ("9.255.0.1", "10.0.0.9", "10.0.0.10") for g in range(4)]
    assert got == want


def test_slot_layout_keeps_real_bundle_indices() -> None:
    """Bundles come back from Ray in arbitrary order: the layout sorts them but keeps their indices."""
    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=False, rollout_num_gpus=8
    )
    physical = [(ip, g) for ip in ("10.0.0.2", "10.0.0.1") for g in range(8)]
    rng = random.Random(7)
    order = list(range(16))
    rng.shuffle(order)
    slots = [GpuSlot(f"n-{ip}", ip, g, bundle) for (ip, g), bundle in zip(physical, order, strict=True)]
    rows = layout_from_slots(alloc, slots)
    check_invariants(alloc, rows)
    by_phys = {(s.ip, s.gpu_id): s.bundle_index for s in slots}
    for a in rows:
        assert a.bundle_index == by_phys[(a.ip, a.gpu_id)]
    assert [(a.ip, a.gpu_id) for a in role_rows(rows, "actor")] == [("10.0.0.1", g) for g in range(8)]


def test_four_gpu_nodes_tp8_engine_would_span_nodes() -> None:
    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=True, rollout_num_gpus_per_engine=8
    )
    with pytest.raises(ConfigError, match=r"rollout_num_gpus_per_engine=8: engine 0 would span nodes"):
        layout(alloc, nodes_of("10.0.0.1", "10.0.0.2", gpus=4))
    disagg = compute_allocation(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        colocate=False,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=8,
    )
    with pytest.raises(
        ConfigError, match=r"rollout_num_gpus_per_engine=8: node 10\.0\.0\.3 .* would span two nodes"
    ):
        layout(disagg, nodes_of("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", gpus=4))


def test_four_gpu_nodes_with_small_engines_fit() -> None:
    alloc = compute_allocation(
        actor_num_nodes=2,
        actor_num_gpus_per_node=4,
        colocate=False,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=4,
    )
    rows = layout(alloc, nodes_of("10.0.0.4", "10.0.0.3", "10.0.0.2", "10.0.0.1", gpus=4))
    check_invariants(alloc, rows)
    assert {a.ip for a in role_rows(rows, "rollout")} == {"10.0.0.3", "10.0.0.4"}


def test_uneven_bundle_spread_cuts_engines_per_node() -> None:
    """A PACK group may land 5 + 11 bundles: rollout GPUs are cut node by node, never across."""
    alloc = compute_allocation(
        actor_num_nodes=1,
        actor_num_gpus_per_node=8,
        colocate=False,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=4,
    )
    slots = [GpuSlot("a", "10.0.0.1", g, g) for g in range(5)] + [
        GpuSlot("b", "10.0.0.2", g, 5 + g) for g in range(11)
    ]
    rows = layout_from_slots(alloc, slots)
    check_invariants(alloc, rows)
    assert {a.node_id for a in role_rows(rows, "rollout")} == {"b"}
    bad = [GpuSlot("a", "10.0.0.1", g, g) for g in range(10)] + [
        GpuSlot("b", "10.0.0.2", g, 10 + g) for g in range(6)
    ]
    with pytest.raises(ConfigError, match="would span two nodes"):
        layout_from_slots(alloc, bad)


@pytest.mark.parametrize(
    ("nodes", "per_node", "colocate", "tp", "critic"),
    [
        (n, p, c, t, cr)
        for n in (1, 2, 3)
        for p in (2, 4, 8)
        for c in (True, False)
        for t in (1, 2)
        for cr in (False, True)
    ],
)
def test_invariants_sweep(nodes: int, per_node: int, colocate: bool, tp: int, critic: bool) -> None:
    alloc = compute_allocation(
        actor_num_nodes=nodes,
        actor_num_gpus_per_node=per_node,
        colocate=colocate,
        rollout_num_gpus=None if colocate else per_node,
        rollout_num_gpus_per_engine=tp,
        use_critic=critic,
    )
    ips = [f"10.0.{i % 3}.{200 - i}" for i in range(alloc.total_nodes)]
    check_invariants(alloc, layout(alloc, nodes_of(*reversed(ips), gpus=per_node)))


def test_too_few_gpus_names_the_shortfall() -> None:
    alloc = compute_allocation(actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True)
    with pytest.raises(
        RaygymError, match="needs 16 GPUs on 2 nodes with 8 each; cluster has 1 node with 8 GPUs"
    ):
        layout(alloc, nodes_of("10.0.0.1"))


def test_shortfall_and_cluster_descriptions() -> None:
    alloc = compute_allocation(actor_num_nodes=2, actor_num_gpus_per_node=8, colocate=True)
    assert shortfall_message(alloc, [8], 8) == (
        "needs 16 GPUs on 2 nodes with 8 each; cluster has 1 node with 8 GPUs (8 free); missing 8 GPUs"
    )
    assert "6 of the GPUs it needs are held" in shortfall_message(alloc, [8, 8], 10)
    assert "strategy STRICT_PACK cannot place 16 bundles" in shortfall_message(
        alloc, [8, 8], 16, strategy="STRICT_PACK"
    )
    assert "missing 4 free CPUs" in shortfall_message(alloc, [8, 8], 16, cpus_needed=16, cpus_free=12)
    assert describe_cluster([8, 4, 8, 0]) == "3 nodes: 2 with 8 GPUs, 1 with 4 GPUs"
    assert describe_cluster([0]) == "no GPUs"


@pytest.mark.parametrize(
    ("trainer", "engine", "field"),
    [
        (0.6, 0.5, "colocate_trainer_gpu_share"),
        (0.0, 0.4, "colocate_trainer_gpu_share"),
        (0.5, 1.5, "colocate_engine_gpu_share"),
    ],
)
def test_share_validation_names_the_field(trainer: float, engine: float, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        validate_shares(trainer, engine)


def test_ip_sort_is_numeric_and_total() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "2.0.0.1", "::1", "node-b", "10.0.1.0"]
    assert sorted(ips, key=ip_sort_key) == ["2.0.0.1", "10.0.0.9", "10.0.0.10", "10.0.1.0", "::1", "node-b"]


def test_render_assignments_lists_every_row() -> None:
    from rich.console import Console

    alloc = compute_allocation(
        actor_num_nodes=1, actor_num_gpus_per_node=4, colocate=True, rollout_num_gpus_per_engine=2
    )
    rows = layout(alloc, nodes_of("10.0.0.1", gpus=4))
    table = render_assignments(rows)
    assert table.row_count == len(rows) == 8
    console = Console(record=True, width=140, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    text = console.export_text()
    assert text.count("rollout") == 4 and text.count("actor") == 4 and "1: 2,3" in text


# -- env contract and sharding (pure parts of raygym.cluster.actor_group) ------------------------------


@pytest.mark.parametrize(
    "key", ["RANK", "MASTER_PORT", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "RAY_ADDRESS"]
)
@pytest.mark.parametrize("field", ["environment", "train_env_vars"])
def test_reserved_env_keys_are_refused_naming_the_key(key: str, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field}\['{key}'\]: {key} is reserved"):
        merge_user_env(**{field: {key: "1"}})


def test_user_env_merges_and_parses_inline_json() -> None:
    env = merge_user_env({"NCCL_DEBUG": "WARN", "A": "env"}, '{"A": "train", "OMP_NUM_THREADS": 2}')
    assert env == {"NCCL_DEBUG": "WARN", "A": "train", "OMP_NUM_THREADS": "2"}
    assert merge_user_env(None, None) == {}
    with pytest.raises(ConfigError, match="train_env_vars=.*not valid JSON"):
        merge_user_env(None, "{oops")


def test_rank_envs_follow_torchrun() -> None:
    envs = build_rank_envs(["n1", "n1", "n2", "n2", "n2"], "10.0.0.1", 29511, {"X": "y"})
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "3", "3", "3"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1", "1"]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["X"]) for e in envs} == {
        ("5", "10.0.0.1", "29511", "y")
    }


@pytest.mark.parametrize(("n_items", "n_shards"), [(0, 3), (5, 2), (8, 4), (7, 8), (100, 7)])
def test_shard_evenly_is_contiguous_and_balanced(n_items: int, n_shards: int) -> None:
    items = list(range(n_items))
    shards = shard_evenly(items, n_shards)
    assert len(shards) == n_shards
    assert [x for s in shards for x in s] == items
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
