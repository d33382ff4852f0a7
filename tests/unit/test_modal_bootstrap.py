"""raygym.launchers.bootstrap with a fake cluster description: commands, addresses, retries, waiting, watchdog."""

from __future__ import annotations

import pytest

from raygym.errors import RaygymError
from raygym.launchers.bootstrap import (
    ClusterSpec,
    HeadWatch,
    NodeWatchdog,
    alive_node_ips,
    backoff_delays,
    dashboard_address,
    format_host,
    head_command,
    host_port,
    normalize_ip,
    ray_address,
    run_with_retries,
    tree_signature,
    wait_for_nodes,
    worker_command,
)

V6 = ("fd00:0:0:0::a", "fd00::b", "fd00::c")
V4 = ("10.0.0.1", "10.0.0.2")


class FakeClock:
    """Time that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_addresses_bracket_ipv6_only():
    assert format_host("fd00::b") == "[fd00::b]" and format_host("[fd00::b]") == "[fd00::b]"
    assert format_host("10.0.0.1") == "10.0.0.1" and format_host("head.local") == "head.local"
    assert host_port("fd00::b", 6379) == "[fd00::b]:6379" and host_port("10.0.0.1", 1) == "10.0.0.1:1"
    spec = ClusterSpec(rank=2, container_ips=V6, gpus_per_node=8, head_port=6380, dashboard_port=8266)
    assert ray_address(spec) == "[fd00::a]:6380"
    assert dashboard_address(spec) == "http://[fd00::a]:8266"
    assert normalize_ip("[fd00:0:0:0::a]") == "fd00::a"


def test_head_command_ipv6_listens_on_all_v6_interfaces():
    cmd = head_command(ClusterSpec(0, V6, gpus_per_node=8))
    assert cmd[:3] == ["ray", "start", "--head"]
    assert _opt(cmd, "--dashboard-host") == "::"
    assert _opt(cmd, "--node-ip-address") == "fd00::a"  # one spelling, no brackets
    assert _opt(cmd, "--num-gpus") == "8" and _opt(cmd, "--port") == "6379"
    v4 = head_command(ClusterSpec(0, V4, gpus_per_node=4), num_cpus=32)
    assert _opt(v4, "--dashboard-host") == "0.0.0.0" and _opt(v4, "--num-cpus") == "32"


def test_worker_command_joins_the_head_with_its_own_ip():
    cmd = worker_command(ClusterSpec(1, V6, gpus_per_node=8))
    assert _opt(cmd, "--address") == "[fd00::a]:6379"
    assert _opt(cmd, "--node-ip-address") == "fd00::b"
    assert "--head" not in cmd


def test_roles_are_enforced():
    with pytest.raises(RaygymError, match="rank 0"):
        worker_command(ClusterSpec(0, V4, 1))
    with pytest.raises(RaygymError, match="only rank 0"):
        head_command(ClusterSpec(1, V4, 1))
    with pytest.raises(RaygymError, match="outside"):
        ClusterSpec(2, V4, 1)


def test_backoff_and_retries_until_success():
    assert backoff_delays(5, 1.0, 2.0, 5.0) == [1.0, 2.0, 4.0, 5.0]
    clock = FakeClock()
    results = iter(["connection refused", "connection refused", None])
    tries = run_with_retries(lambda: next(results), backoff_delays(5, 1.0), "join", sleep=clock.sleep)
    assert tries == 3 and clock.sleeps == [1.0, 2.0]


def test_retries_exhausted_raise_with_every_failure():
    clock = FakeClock()
    with pytest.raises(
        RaygymError, match=r"join head failed after 3 tries:\ntry 1: e1\ntry 2: e2\ntry 3: e3"
    ):
        errs = iter(["e1", "e2", "e3"])
        run_with_retries(lambda: next(errs), [1.0, 1.0], "join head", sleep=clock.sleep)
    assert clock.sleeps == [1.0, 1.0]


def test_alive_node_ips_from_ray_nodes_listing():
    nodes = [
        {"NodeManagerAddress": "fd00:0::a", "Alive": True},
        {"NodeManagerAddress": "fd00::b", "Alive": False},
        {"NodeManagerAddress": "10.0.0.2", "Alive": True},
    ]
    assert alive_node_ips(nodes) == {"fd00::a", "10.0.0.2"}


def test_wait_for_nodes_returns_once_all_joined():
    spec = ClusterSpec(0, V6, 8)
    clock = FakeClock()
    joined = [{"fd00::a"}, {"fd00::a", "fd00::b"}, {"fd00::a", "fd00::b", "fd00::c"}]
    took = wait_for_nodes(spec, lambda: joined.pop(0), 60, 2.0, clock, clock.sleep)
    assert took == 4.0 and joined == []


def test_wait_for_nodes_times_out_naming_missing_ranks():
    spec = ClusterSpec(0, V6, 8)
    clock = FakeClock()
    with pytest.raises(RaygymError) as err:
        wait_for_nodes(spec, lambda: {"fd00::a", "fd00::b"}, 10, 2.0, clock, clock.sleep)
    text = str(err.value)
    assert "only 2 of 3 nodes" in text and "[fd00::a]:6379" in text
    assert "rank 2 fd00::c missing" in text and "rank 1 fd00::b alive" in text
    assert clock.now >= 10


def test_head_watch_exits_after_grace_and_resets_on_contact():
    watch = HeadWatch(grace_s=30)
    assert not watch.observe(0, False)
    assert not watch.observe(20, False)
    assert not watch.observe(25, True)  # head back: the clock restarts
    assert not watch.observe(40, False)
    assert not watch.observe(69, False)
    assert watch.observe(70, False)


def test_watchdog_fails_after_node_dead_for_60s_with_diagnostics():
    spec = ClusterSpec(0, V6, 8)
    dog = NodeWatchdog(spec, dead_after_s=60)
    everyone = {"fd00::a", "fd00::b", "fd00::c"}
    assert dog.observe(0, everyone) is None
    assert dog.observe(10, everyone - {"fd00::c"}) is None  # dead since 10
    assert dog.observe(40, everyone) is None  # came back: forgiven
    assert dog.observe(50, everyone - {"fd00::c"}) is None  # dead since 50
    assert dog.observe(109, everyone - {"fd00::c"}) is None
    failure = dog.observe(110, everyone - {"fd00::c"})
    assert failure is not None and failure.rank == 2 and failure.ip == "fd00::c"
    assert failure.dead_for_s == 60
    assert "rank 2 fd00::c: DEAD for 60 s (last alive 70 s ago)" in failure.diagnostics
    assert "rank 1 fd00::b: alive" in failure.diagnostics


def test_watchdog_node_never_seen():
    dog = NodeWatchdog(ClusterSpec(0, V4, 1), dead_after_s=60)
    assert dog.observe(0, {"10.0.0.1"}) is None
    failure = dog.observe(60, {"10.0.0.1"})
    assert failure is not None and "never seen alive" in failure.diagnostics


def test_tree_signature_changes_when_checkpoints_are_written(tmp_path):
    root = tmp_path / "ckpt"
    assert tree_signature(str(root)) == {}
    (root / "step_1").mkdir(parents=True)
    (root / "step_1" / "model.safetensors").write_bytes(b"x" * 10)
    first = tree_signature(str(root))
    assert first == {"step_1/model.safetensors": (10, first["step_1/model.safetensors"][1])}
    assert tree_signature(str(root)) == first
    (root / "step_2").mkdir()
    (root / "step_2" / "DONE").write_text("")
    assert tree_signature(str(root)) != first
