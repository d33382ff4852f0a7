"""A throttled link on one machine: a network namespace joined to this one by a veth pair, shaped with tc.

Receivers that enter the namespace reach the sender only through the pair, whose sender-side end is
rate-limited with a token bucket (``tc qdisc ... tbf``), so "across nodes" is measured on one host.
Needs root and iproute2; everything created carries this process's id in its name and is removed by
name on exit (also on errors and SIGTERM). Traffic never leaves the machine.

>>> with ShapedLink() as link:                           # doctest: +SKIP
...     link.set_rate_gbit(1.0)
...     # start receivers with netns=link.netns_path, ifname=link.ns_if; the sender uses link.host_ip
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from types import FrameType
from typing import Any


def available() -> str | None:
    """None when namespaces and tc can be used here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns / tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc): apt-get install -y iproute2"
    return None


class ShapedLink:
    """Namespace ``rgws<pid>`` with veth ``rgws<pid>h`` (here, ``host_ip``) <-> ``rgws<pid>n`` (there, ``ns_ip``)."""

    def __init__(self, subnet: str | None = None):
        tag = f"rgws{os.getpid() % 100000}"
        subnet = subnet or f"10.231.{os.getpid() % 250}"
        self.netns = tag
        self.host_if, self.ns_if = f"{tag}h", f"{tag}n"
        self.host_ip, self.ns_ip = f"{subnet}.1", f"{subnet}.2"
        self.rate_gbit: float | None = None
        self.shaping = "unshaped"
        self._created: list[str] = []
        self._old_sigterm: Callable[[int, FrameType | None], Any] | int | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def __enter__(self) -> ShapedLink:
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._sh("ip", "netns", "add", self.netns)
            self._created.append("netns")
            self._sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._created.append("veth")
            self._sh("ip", "link", "set", self.ns_if, "netns", self.netns)
            self._sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            self._sh("ip", "link", "set", self.host_if, "up")
            self._ns("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self._ns("ip", "link", "set", self.ns_if, "up")
            self._ns("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_rate_gbit(self, gbit: float | None, delay_ms: float = 1.0) -> str:
        """Shape both directions to ``gbit`` (None: unshaped) with ``delay_ms`` of delay each way where the
        kernel has netem; else a token bucket alone (burst = 10 ms at the rate, at most 50 ms queued).
        Returns what was set up, in words."""
        self.shaping = "unshaped"
        for dev, run in ((self.host_if, self._sh), (self.ns_if, self._ns)):
            subprocess.run(self._prefix(run) + ["tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, check=False)
            if gbit is None:
                continue
            netem = self._prefix(run) + ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay",
                                         f"{delay_ms}ms", "rate", f"{gbit}gbit", "limit", "100000"]
            if subprocess.run(netem, capture_output=True, check=False).returncode == 0:
                self.shaping = f"netem rate {gbit:g}gbit delay {delay_ms:g}ms each way"
                continue
            burst = max(64 * 1024, int(gbit * 1e9 / 8 / 100))
            run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", str(burst),
                "latency", "50ms")
            self.shaping = f"tbf rate {gbit:g}gbit each way, no added delay (this kernel has no sch_netem)"
        self.rate_gbit = gbit
        return self.shaping

    def close(self) -> None:
        """Remove what this link created (by name), in reverse order."""
        if "veth" in self._created:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        if "netns" in self._created:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        self._created.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _prefix(self, run) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if run == self._ns else []

    @staticmethod
    def _sh(*cmd: str) -> None:
        subprocess.run(list(cmd), check=True, capture_output=True)

    def _ns(self, *cmd: str) -> None:
        self._sh("ip", "netns", "exec", self.netns, *cmd)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
