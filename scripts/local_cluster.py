"""A Ray cluster of separate nodes on this machine: every node its own network namespace and address.

The head and each worker run ``ray start --block`` inside their own namespace (``ip netns exec``), joined by
a Linux bridge in the host namespace (which also gets an address, so this process can submit jobs to the
head's dashboard). Each node has its own address, its own ports, its own Ray temp dir and logical GPUs
(``--num-gpus`` on a machine without GPUs), and reaches the others only over its veth pair, where ``tc``
can shape the link. Traffic never leaves the machine: the namespaces' default route points at the bridge
with no gateway, and the host does not forward.

A node "dies" as a machine would: every process in its namespace is SIGKILLed (the raylet, its workers and
anything they started, e.g. an engine's server); :meth:`LocalCluster.start_node` brings it back under the
same address with a fresh temp dir. Everything this harness creates carries its process id in its name
(``rgm<pid><letter>``) and is removed by :meth:`LocalCluster.close` (also on errors and SIGTERM); leftovers of a
harness whose process died are removed by :func:`remove_stale`.

Needs root and iproute2 (:func:`unavailable` says why not).

    with LocalCluster(worker_gpus=(1, 1, 1)) as cluster:
        submit_train_job(cluster.dashboard_url, [...])   # raygym.launchers.ray_job
        cluster.kill_node("w2"); cluster.start_node("w2")

CLI (runs until Ctrl-C, then tears everything down)::

    python scripts/local_cluster.py --workers 1,1,1 [--head-gpus 0] [--shape w1=1.0]
    python scripts/local_cluster.py --remove-stale
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raygym.cluster.shape import HEAD_HOST, ClusterShape

PREFIX = "rgm"
GCS_PORT = 46379
DASHBOARD_PORT = 48265
# The GCS declares a node dead after `period x threshold` of failed checks (Ray's defaults take ~30 s).
FAST_FAILURE_DETECTION = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "1000",
                          "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}


_INSTANCES = itertools.count()  # clusters made by this process (several may be up at once)


def unavailable() -> str | None:
    """None when this machine can make the cluster, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns) and tc"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"needs iproute2 ({tool} not found): apt-get install -y iproute2"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Node:
    """One Ray node: its namespace, address, logical GPUs and (while up) its ``ray start --block`` process."""

    name: str
    ip: str
    num_gpus: int
    num_cpus: int
    netns: str
    host_if: str  # the veth end on the bridge, in the host namespace
    is_head: bool = False
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    shaping: str = "unshaped"
    temp_dirs: list[str] = field(default_factory=list)

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _sh(*cmd: str) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")


def _used_subnets() -> set[str]:
    out = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line and "/" in line.split()[0]}


def _free_subnet(start: int) -> str:
    used = _used_subnets()
    for k in range(250):
        net = f"10.232.{(start + k) % 250}.0/24"
        if not any(ipaddress.ip_network(net).overlaps(ipaddress.ip_network(u, strict=False)) for u in used):
            return net
    raise RuntimeError("no free 10.232.x.0/24 subnet for the cluster's bridge")


class LocalCluster:
    """A Ray head (``head_gpus`` logical GPUs) and one worker per entry of ``worker_gpus``, each in its own
    network namespace on one bridge. Node names: ``head``, ``w1``, ``w2``, ...; addresses ``.10`` (head),
    ``.11``, ``.12``, ... of a free ``10.232.x.0/24``; the host is ``.1``.

    ``env``: extra variables for every node (and so for every Ray worker and job driver there).
    ``fast_failure_detection``: the head declares a dead node dead in ~3 s instead of Ray's ~30 s.
    """

    def __init__(self, worker_gpus: Sequence[int] = (1, 1, 1), *, head_gpus: int = 0, num_cpus: int = 4,
                 object_store_mb: int = 200, env: Mapping[str, str] | None = None,
                 fast_failure_detection: bool = True, say: Callable[[str], Any] = lambda s: None) -> None:
        self.tag = f"{PREFIX}{os.getpid()}{chr(ord('a') + next(_INSTANCES) % 26)}"  # <= 15 chars with suffixes
        self.subnet = ipaddress.ip_network(_free_subnet(os.getpid()))
        base = self.subnet.network_address
        self.host_ip = str(base + 1)
        self.bridge = f"{self.tag}b"
        self.object_store_mb = object_store_mb
        self.say = say
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))  # short: Ray's socket paths
        specs = [("head", head_gpus, True)] + [(f"w{i}", g, False) for i, g in enumerate(worker_gpus, 1)]
        self.nodes: dict[str, Node] = {
            name: Node(name, str(base + HEAD_HOST + i), gpus, num_cpus, f"{self.tag}-{name}", f"{self.tag}v{i}", head)
            for i, (name, gpus, head) in enumerate(specs)
        }
        node_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
        node_env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})
        if fast_failure_detection:
            node_env.update(FAST_FAILURE_DETECTION)
        node_env.update(env or {})
        self.env = node_env
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._old_sigterm: Any = None

    @classmethod
    def of_shape(cls, shape: ClusterShape, **kwargs: Any) -> LocalCluster:
        """The cluster a recipe's :class:`raygym.cluster.shape.ClusterShape` describes (what KubeRay or Modal
        would build for it), e.g. ``LocalCluster.of_shape(cluster_shape(recipe))``."""
        return cls(shape.worker_gpus, head_gpus=shape.head_gpus, **kwargs)

    # ---- addresses --------------------------------------------------------------------------------
    @property
    def head(self) -> Node:
        return self.nodes["head"]

    @property
    def gcs_address(self) -> str:
        """``ip:port`` of the head's GCS (what ``ray start --address`` and ``RAY_ADDRESS`` on a node take)."""
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        """The head's dashboard, reachable from this (host) process: job submission, state API."""
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def node_by_ip(self, ip: str) -> Node:
        return next(n for n in self.nodes.values() if n.ip == ip)

    # ---- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._make_network()
            for node in self.nodes.values():
                self._launch(node)
                if node.is_head:
                    self._wait(lambda: self._dashboard_up(), 90, "the head's dashboard to answer", node)
            self.wait_alive(list(self.nodes))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every node's processes, then remove the namespaces, links and bridge (idempotent)."""
        for node in reversed(list(self.nodes.values())):
            self._kill(node)
        for kind, name in reversed(self._made):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True)
        self._made.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def kill_node(self, name: str) -> list[int]:
        """The node dies: SIGKILL every process in its namespace (its raylet, workers, servers). Returns
        the pids killed. Its address stays, so peers get refused connections, as from a rebooting machine."""
        node = self.nodes[name]
        if node.is_head:
            raise ValueError("killing the head ends the cluster; raygym does not survive it (see docs/multinode.md)")
        return self._kill(node)

    def start_node(self, name: str, timeout_s: float = 90.0) -> None:
        """Start node ``name`` again (same address and resources, fresh temp dir) and wait until it is alive."""
        node = self.nodes[name]
        if node.up:
            raise RuntimeError(f"node {name} is up; kill_node() it first")
        self._launch(node)
        self.wait_alive([name], timeout_s)

    def ensure_up(self) -> list[str]:
        """Start every worker node that is down (a test killed it) and wait for them; returns their names."""
        down = [n.name for n in self.nodes.values() if not n.up and not n.is_head]
        for name in down:
            self._launch(self.nodes[name])
        if down:
            self.wait_alive(down)
        return down

    def shape(self, name: str, gbit: float | None) -> str:
        """Limit node ``name``'s link to ``gbit`` Gbit/s each way (token bucket on both veth ends); None
        removes the limit. Returns what was set, in words."""
        node = self.nodes[name]
        for prefix, dev in ((["ip", "netns", "exec", node.netns], "eth0"), ([], node.host_if)):
            subprocess.run(prefix + ["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if gbit is not None:
                burst = max(64 * 1024, int(gbit * 1e9 / 8 / 100))  # 10 ms at the rate
                _sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit",
                    "burst", str(burst), "latency", "50ms")
        node.shaping = "unshaped" if gbit is None else f"tbf {gbit:g} Gbit/s each way"
        return node.shaping

    def exec_in(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``name``'s namespace (with the nodes' environment) and wait for it."""
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run(["ip", "netns", "exec", self.nodes[name].netns, *argv], env=env, text=True,
                              capture_output=True, **kwargs)

    # ---- state ------------------------------------------------------------------------------------
    def ray_nodes(self) -> list[dict[str, Any]]:
        """Every node the head knows (the dashboard's state API): ``node_ip``, ``state``, ``resources_total``."""
        body = self._get("/api/v0/nodes?limit=1000&detail=true")
        return list(body["data"]["result"]["result"])

    def actors(self, state: str = "ALIVE") -> list[tuple[str, str]]:
        """(class name, node address) of every actor in ``state`` (the dashboard's state API)."""
        ip_of = {n["node_id"]: n["node_ip"] for n in self.ray_nodes()}
        body = self._get("/api/v0/actors?limit=10000&detail=true")
        return sorted((a["class_name"], ip_of.get(a["node_id"], "?")) for a in body["data"]["result"]["result"]
                      if a["state"] == state)

    def alive_ips(self) -> set[str]:
        return {n["node_ip"] for n in self.ray_nodes() if n["state"] == "ALIVE"}

    def wait_alive(self, names: Sequence[str], timeout_s: float = 90.0) -> None:
        """Block until the head lists every node of ``names`` as ALIVE."""
        want = {self.nodes[n].ip for n in names}
        for name in names:
            self._wait(lambda: want <= self._alive_or_empty(), timeout_s, f"node {name} to join", self.nodes[name])

    def wait_dead(self, name: str, timeout_s: float = 60.0) -> float:
        """Block until the head no longer lists node ``name`` as ALIVE; returns the seconds it took."""
        t0 = time.monotonic()
        ip = self.nodes[name].ip
        self._wait(lambda: ip not in self._alive_or_empty(), timeout_s, f"the head to see node {name} dead",
                   self.head)
        return time.monotonic() - t0

    def describe(self) -> dict[str, Any]:
        """Addresses and shapes, JSON-ready."""
        return {"gcs_address": self.gcs_address, "dashboard_url": self.dashboard_url, "host_ip": self.host_ip,
                "nodes": [{"name": n.name, "ip": n.ip, "gpus": n.num_gpus, "netns": n.netns, "link": n.shaping}
                          for n in self.nodes.values()]}

    # ---- internals --------------------------------------------------------------------------------
    def _make_network(self) -> None:
        prefix = self.subnet.prefixlen
        _sh("ip", "link", "add", "name", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _sh("ip", "addr", "add", f"{self.host_ip}/{prefix}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes.values():
            _sh("ip", "netns", "add", node.netns)
            self._made.append(("netns", node.netns))
            peer = f"{node.host_if}n"
            _sh("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", peer)
            self._made.append(("link", node.host_if))
            _sh("ip", "link", "set", peer, "netns", node.netns)
            _sh("ip", "link", "set", node.host_if, "master", self.bridge)
            _sh("ip", "link", "set", node.host_if, "up")
            ns = ["ip", "netns", "exec", node.netns]
            _sh(*ns, "ip", "link", "set", peer, "name", "eth0")
            _sh(*ns, "ip", "addr", "add", f"{node.ip}/{prefix}", "dev", "eth0")
            _sh(*ns, "ip", "link", "set", "eth0", "up")
            _sh(*ns, "ip", "link", "set", "lo", "up")
            # No gateway: an address outside the bridge is unreachable (ARP goes unanswered), yet a
            # "which address would I use" lookup (Ray's, gloo's) finds eth0's, as on a real node.
            _sh(*ns, "ip", "route", "add", "default", "dev", "eth0")

    def _launch(self, node: Node) -> None:
        node.starts += 1
        temp = self.root / f"{node.name}-{node.starts}"
        temp.mkdir()
        node.temp_dirs.append(str(temp))
        common = ["--block", "--node-ip-address", node.ip, "--num-cpus", str(node.num_cpus),
                  "--num-gpus", str(node.num_gpus), "--resources", json.dumps({f"node_name:{node.name}": 1}),
                  "--object-store-memory", str(self.object_store_mb * 1024 * 1024), "--temp-dir", str(temp),
                  "--disable-usage-stats"]
        if node.is_head:
            role = ["--head", "--port", str(GCS_PORT), "--dashboard-host", "0.0.0.0",
                    "--dashboard-port", str(DASHBOARD_PORT), "--include-dashboard", "true"]
        else:
            role = ["--address", self.gcs_address]
        cmd = ["ip", "netns", "exec", node.netns, sys.executable, "-m", "ray.scripts.scripts", "start",
               *role, *common]
        log = open(temp / "ray-start.log", "wb")  # noqa: SIM115 - the child holds it
        node.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.say(f"local cluster: started node {node.name} at {node.ip} ({node.num_gpus} GPUs)")

    def _kill(self, node: Node) -> list[int]:
        killed: list[int] = []
        if any(kind == "netns" and name == node.netns for kind, name in self._made):
            for _ in range(50):  # a raylet may be forking while we kill: repeat until the namespace is empty
                pids = _netns_pids(node.netns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        if node.proc is not None:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            node.proc = None
        return sorted(set(killed))

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, node: Node) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline or (node.proc is not None and node.proc.poll() is not None):
                raise RuntimeError(f"timed out waiting for {what}; ray start log of {node.name}:\n"
                                   + self._log_tail(node))
            time.sleep(0.3)

    def _log_tail(self, node: Node, lines: int = 40) -> str:
        if not node.temp_dirs:
            return ""
        path = Path(node.temp_dirs[-1]) / "ray-start.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(self.dashboard_url + path, timeout=10) as answer:
            return json.loads(answer.read())

    def _dashboard_up(self) -> bool:
        try:
            self._get("/api/version")
            return True
        except (OSError, ValueError):
            return False

    def _alive_or_empty(self) -> set[str]:
        try:
            return self.alive_ips()
        except (OSError, ValueError, KeyError):
            return set()


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def remove_stale() -> list[str]:
    """Remove namespaces and links of harnesses whose process is gone (names ``rgm<pid>...``); returns them."""
    removed = []
    pid_of = re.compile(rf"^{PREFIX}(\d+)")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
    names = [("netns", line.split()[0]) for line in netns if line.strip()]
    names += [("link", line.split(":")[1].strip().split("@")[0]) for line in links]
    for kind, name in names:
        match = pid_of.match(name)
        if not match or Path(f"/proc/{match.group(1)}").exists():
            continue
        if kind == "netns":
            for pid in _netns_pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            removed.append(f"{kind} {name}")
    return removed


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/local_cluster.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,1,1", help="logical GPUs of each worker node, comma separated")
    p.add_argument("--head-gpus", type=int, default=0)
    p.add_argument("--shape", action="append", default=[], help="NODE=GBIT: limit a node's link (repeatable)")
    p.add_argument("--remove-stale", action="store_true", help="remove leftovers of dead harnesses and exit")
    opts = p.parse_args(argv)
    if opts.remove_stale:
        print("\n".join(remove_stale()) or "nothing stale")
        return 0
    why = unavailable()
    if why:
        print(f"cannot make a local cluster: {why}", file=sys.stderr)
        return 3
    workers = [int(g) for g in opts.workers.split(",") if g.strip()]
    with LocalCluster(workers, head_gpus=opts.head_gpus, say=print) as cluster:
        for item in opts.shape:
            name, gbit = item.split("=", 1)
            cluster.shape(name, float(gbit))
        print(json.dumps(cluster.describe(), indent=2))
        print(f"submit: raygym submit --address {cluster.dashboard_url} --preset tiny ...; Ctrl-C ends it")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
