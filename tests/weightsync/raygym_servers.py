"""raygym servers in subprocesses for the weight-sync tests: started, waited on until healthy, ended by their
own handles."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import httpx

from raygym.weightsync.payload import LOADER
from raygym.weightsync.transport_dist import free_port


@contextlib.contextmanager
def raygym_servers(model_path: str, count: int, dtype: str, extra_args: Sequence[str] = (),
                   timeout_s: float = 120.0) -> Iterator[list[str]]:
    """``count`` raygym servers on CPU with raygym's loader registered; yields their URLs."""
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        for _ in range(count):
            port = free_port("127.0.0.1")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "raygym.engines.raygym_server.server", "--model-path", model_path, "--host", "127.0.0.1",
                 "--port", str(port), "--device", "cpu", "--dtype", dtype, "--custom-weight-loader", LOADER,
                 *extra_args], env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            wait_healthy(proc, url, timeout_s)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Until ``url/health`` answers 200; fails when the server exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server {url} exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"server {url} not healthy in {timeout_s} s"
        time.sleep(0.3)
