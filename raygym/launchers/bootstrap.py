"""Pure decisions for turning N clustered containers into one Ray cluster.

Every choice the Modal launcher makes about the cluster lives here so it can be tested with a fake
cluster description: which container is the head, the ``ray start`` command lines, addresses (IPv6 in
brackets), join retries, waiting for all nodes, the worker's "head is gone" rule and the node-liveness
watchdog. Nothing here imports ``modal`` or ``ray``; time, sleeping and probing come in as callables.

>>> spec = ClusterSpec(rank=1, container_ips=("fd00::1", "fd00::2"), gpus_per_node=8)
>>> ray_address(spec)
'[fd00::1]:6379'
>>> worker_command(spec)[:4]
['ray', 'start', '--address', '[fd00::1]:6379']
"""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from raygym.errors import RaygymError

DEFAULT_HEAD_PORT = 6379
DEFAULT_DASHBOARD_PORT = 8265


@dataclass(frozen=True)
class ClusterSpec:
    """What one container knows about its cluster: its rank and every container's IP (rank order).

    Rank 0 is the Ray head; every other rank runs a Ray worker node.
    """

    rank: int
    container_ips: tuple[str, ...]
    gpus_per_node: int
    head_port: int = DEFAULT_HEAD_PORT
    dashboard_port: int = DEFAULT_DASHBOARD_PORT

    def __post_init__(self) -> None:
        if not self.container_ips:
            raise RaygymError("cluster description has no container IPs")
        if not 0 <= self.rank < len(self.container_ips):
            raise RaygymError(f"rank {self.rank} outside the cluster of {len(self.container_ips)} containers")

    @property
    def size(self) -> int:
        return len(self.container_ips)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def head_ip(self) -> str:
        return self.container_ips[0]

    @property
    def own_ip(self) -> str:
        return self.container_ips[self.rank]


def is_ipv6(host: str) -> bool:
    """True for a literal IPv6 address (with or without brackets)."""
    try:
        return isinstance(ipaddress.ip_address(host.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def format_host(host: str) -> str:
    """``host`` as it must appear before ``:port`` or inside a URL: IPv6 literals get brackets.

    >>> format_host("fd00::1"), format_host("[fd00::1]"), format_host("10.0.0.1")
    ('[fd00::1]', '[fd00::1]', '10.0.0.1')
    """
    bare = host.strip("[]")
    return f"[{normalize_ip(bare)}]" if is_ipv6(bare) else host


def host_port(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals bracketed (``[fd00::1]:6379``)."""
    return f"{format_host(host)}:{int(port)}"


def normalize_ip(host: str) -> str:
    """One spelling per address, so IPs reported by Ray compare equal to the ones we passed in."""
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare


def ray_address(spec: ClusterSpec) -> str:
    """The GCS address workers join (``ray start --address``)."""
    return host_port(spec.head_ip, spec.head_port)


def dashboard_address(spec: ClusterSpec) -> str:
    """The head's job-submission URL (``http://host:8265``), usable from any container of the cluster."""
    return f"http://{host_port(spec.head_ip, spec.dashboard_port)}"


def _node_flags(spec: ClusterSpec, num_cpus: int | None) -> list[str]:
    flags = ["--node-ip-address", normalize_ip(spec.own_ip), "--num-gpus", str(spec.gpus_per_node)]
    if num_cpus is not None:
        flags += ["--num-cpus", str(num_cpus)]
    return flags + ["--disable-usage-stats"]


def head_command(spec: ClusterSpec, num_cpus: int | None = None) -> list[str]:
    """``ray start --head`` for rank 0; the dashboard listens on every interface of the right family."""
    if not spec.is_head:
        raise RaygymError(f"head_command called on rank {spec.rank}; only rank 0 runs the Ray head")
    listen_all = "::" if is_ipv6(spec.head_ip) else "0.0.0.0"
    return [
        "ray", "start", "--head",
        "--port", str(spec.head_port),
        "--dashboard-host", listen_all,
        "--dashboard-port", str(spec.dashboard_port),
        *_node_flags(spec, num_cpus),
    ]  # fmt: skip


def worker_command(spec: ClusterSpec, num_cpus: int | None = None) -> list[str]:
    """``ray start --address <head>`` for ranks > 0 (returns once the node has joined)."""
    if spec.is_head:
        raise RaygymError("worker_command called on rank 0; rank 0 runs the Ray head")
    return ["ray", "start", "--address", ray_address(spec), *_node_flags(spec, num_cpus)]


def backoff_delays(
    attempts: int, initial_s: float = 2.0, factor: float = 2.0, cap_s: float = 30.0
) -> list[float]:
    """Sleeps between ``attempts`` tries: exponential from ``initial_s``, capped at ``cap_s``.

    >>> backoff_delays(5, 1.0, 2.0, 5.0)
    [1.0, 2.0, 4.0, 5.0]
    """
    return [min(cap_s, initial_s * factor**i) for i in range(max(0, attempts - 1))]


def run_with_retries(
    action: Callable[[], str | None],
    delays: list[float],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Call ``action`` until it returns None (success); it returns an error text on failure.

    Tries ``len(delays) + 1`` times, sleeping ``delays[i]`` after failure i. Returns the number of
    tries used; raises :class:`RaygymError` with every failure's text when all of them failed.
    """
    failures: list[str] = []
    for attempt in range(len(delays) + 1):
        error = action()
        if error is None:
            return attempt + 1
        failures.append(f"try {attempt + 1}: {error}")
        if attempt < len(delays):
            sleep(delays[attempt])
    raise RaygymError(f"{what} failed after {len(failures)} tries:\n" + "\n".join(failures))


def alive_node_ips(nodes: Iterable[Mapping]) -> set[str]:
    """Normalised IPs of the alive nodes in a ``ray.nodes()`` listing."""
    return {normalize_ip(n["NodeManagerAddress"]) for n in nodes if n.get("Alive")}


def describe_nodes(spec: ClusterSpec, alive: set[str]) -> str:
    """One line per rank: ``rank 1 fd00::2 alive|missing`` (for error messages)."""
    lines = []
    for rank, ip in enumerate(spec.container_ips):
        state = "alive" if normalize_ip(ip) in alive else "missing"
        lines.append(f"rank {rank} {normalize_ip(ip)} {state}")
    return "\n".join(lines)


def wait_for_nodes(
    spec: ClusterSpec,
    probe_alive: Callable[[], set[str]],
    timeout_s: float,
    interval_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Block until every container's IP is an alive Ray node; returns the seconds it took.

    Raises :class:`RaygymError` naming the missing ranks when ``timeout_s`` passes first.
    """
    expected = {normalize_ip(ip) for ip in spec.container_ips}
    start = clock()
    while True:
        alive = probe_alive()
        if expected <= alive:
            return clock() - start
        if clock() - start >= timeout_s:
            missing = sorted(expected - alive)
            raise RaygymError(
                f"only {len(expected & alive)} of {spec.size} nodes joined the Ray head at "
                f"{ray_address(spec)} within {timeout_s:.0f} s; missing {missing}.\n"
                f"{describe_nodes(spec, alive)}\n"
                "Check the logs of the missing ranks (ray start errors, network) or raise join_timeout_s."
            )
        sleep(interval_s)


@dataclass
class HeadWatch:
    """A worker's rule for leaving: the head has been unreachable for ``grace_s`` seconds in a row."""

    grace_s: float = 30.0
    _down_since: float | None = None

    def observe(self, now: float, head_reachable: bool) -> bool:
        """Record one probe; True when the worker should exit."""
        if head_reachable:
            self._down_since = None
            return False
        if self._down_since is None:
            self._down_since = now
        return now - self._down_since >= self.grace_s


@dataclass(frozen=True)
class NodeFailure:
    """A node the watchdog gave up on, with the text to show the user."""

    rank: int
    ip: str
    dead_for_s: float
    diagnostics: str


@dataclass
class NodeWatchdog:
    """Fails the run when any expected node stays dead for ``dead_after_s`` seconds (default 60).

    Feed it ``observe(now, alive_ips)`` from a poll loop; a node that comes back resets its clock.
    """

    spec: ClusterSpec
    dead_after_s: float = 60.0
    _dead_since: dict[str, float] = field(default_factory=dict)
    _last_alive: dict[str, float] = field(default_factory=dict)

    def observe(self, now: float, alive_ips: set[str]) -> NodeFailure | None:
        worst: tuple[float, int, str] | None = None
        for rank, ip in enumerate(self.spec.container_ips):
            key = normalize_ip(ip)
            if key in alive_ips:
                self._dead_since.pop(key, None)
                self._last_alive[key] = now
                continue
            since = self._dead_since.setdefault(key, now)
            dead_for = now - since
            if dead_for >= self.dead_after_s and (worst is None or dead_for > worst[0]):
                worst = (dead_for, rank, ip)
        if worst is None:
            return None
        dead_for, rank, ip = worst
        return NodeFailure(rank, ip, dead_for, self.diagnostics(now, alive_ips))

    def diagnostics(self, now: float, alive_ips: set[str]) -> str:
        lines = [f"node liveness (dead after {self.dead_after_s:.0f} s):"]
        for rank, ip in enumerate(self.spec.container_ips):
            key = normalize_ip(ip)
            if key in alive_ips:
                lines.append(f"  rank {rank} {ip}: alive")
                continue
            last = self._last_alive.get(key)
            seen = f"last alive {now - last:.0f} s ago" if last is not None else "never seen alive"
            lines.append(
                f"  rank {rank} {ip}: DEAD for {now - self._dead_since.get(key, now):.0f} s ({seen})"
            )
        return "\n".join(lines)


def tree_signature(root: str) -> dict[str, tuple[int, int]]:
    """``{relative path: (size, mtime_ns)}`` of every file under ``root`` ({} if it does not exist).

    Two signatures differ exactly when a file was added, removed or rewritten: the cue to commit a volume.
    """
    signature: dict[str, tuple[int, int]] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # removed while walking
                continue
            signature[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return signature
