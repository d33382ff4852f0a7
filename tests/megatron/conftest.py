"""Fixtures for the Megatron backend tests.

Without CUDA the backend runs in its CPU mode (``raygym.trainer.megatron_cpu``, applied by
``MegatronBackend.init``); these tests patch nothing themselves.

Tests run each configuration in fresh processes (one per rank, on the torchrun environment contract)
because Megatron's parallel state is process-global.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def megatron_skip_reason() -> str | None:
    """Why the megatron tests cannot run here, or None when they can."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed (pip install 'raygym[megatron]'; 0.16.x on Python 3.11)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world: int, timeout: float = 240.0, script: Path | None = None) -> None:
    """Start ``script`` (default ``tp_worker.py``) with ``args`` as ``world`` ranks with torchrun-style env;
    fail with their output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script or HERE / "tp_worker.py"), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # only our own children, by handle
                p.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {i} ---\n{out[-4000:]}" for i, out in enumerate(outputs))
        raise AssertionError(f"ranks {failed} failed:\n{tails}")


@pytest.fixture(scope="session")
def megatron_available() -> None:
    reason = megatron_skip_reason()
    if reason:
        print(f"SKIP megatron tests: {reason}")
        pytest.skip(reason)
