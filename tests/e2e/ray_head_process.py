"""A private Ray head for e2e tests: ``ray start --head --block`` on free ports, in its own RAY_TMPDIR
and process group, ended by that group's id — nothing else on the machine is touched."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def head_env(**overrides: str) -> tuple[str, dict[str, str]]:
    """(a short RAY_TMPDIR, the environment for the head and its clients). Short: Ray's socket paths
    have a length limit. ``RAY_ADDRESS`` is dropped so nothing attaches to another cluster."""
    tmp = tempfile.mkdtemp(prefix="rgh-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0", **overrides}
    env.pop("RAY_ADDRESS", None)
    return tmp, env


@contextmanager
def ray_head_process(
    port_args: list[str], env: dict[str, str], ready: Callable[[], bool], timeout_s: float = 90.0,
    *, python: str = sys.executable, cwd: str | None = None,
) -> Iterator[None]:
    """Run a head (4 CPUs, 2 logical GPUs) with ``port_args`` (every port flag, so no default port is
    taken) until the block exits; ``ready()`` is polled until it is true. ``python``: the interpreter whose Ray
    runs it (an installed raygym's, for tests/wheel); ``cwd``: the head's working directory."""
    tmp = env["RAY_TMPDIR"]
    cmd = [python, "-m", "ray.scripts.scripts", "start", "--head", "--block",
           "--node-ip-address", "127.0.0.1", *port_args, "--num-cpus", "4", "--num-gpus", "2",
           "--object-store-memory", str(256 * 1024 * 1024), "--disable-usage-stats"]  # fmt: skip
    log = open(Path(tmp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray head did not come up:\n{(Path(tmp) / 'ray-start.log').read_text()}")
            time.sleep(0.5)
        yield
    finally:
        # Our own process group only: `ray start --block` ends the Ray processes it spawned on SIGTERM;
        # anything of that group still alive afterwards is killed by the group id.
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        log.close()
