"""Fixtures for the Megatron backend tests, with the CPU monkeypatches megatron-core needs.

megatron-core targets CUDA and hard-codes a few ``torch.cuda`` calls that a CPU-only torch rejects.
The patches below exist ONLY for these tests (the backend itself never patches Megatron); each one
replaces a CUDA call by its CPU equivalent and changes no maths:

1. ``torch.cuda.current_device`` -> ``"cpu"``: Megatron allocates buffers with
   ``device=torch.cuda.current_device()`` (rotary ``inv_freq``, tensor-parallel gather buffers, the
   vocab-parallel embedding mask). Returning the string ``"cpu"`` puts them on the CPU.
2. The CUDA RNG state used by Megatron's RNG tracker (``model_parallel_cuda_manual_seed`` and
   ``get_cuda_rng_tracker().fork()`` around dropout): ``torch.cuda.get_rng_state`` /
   ``torch.cuda.manual_seed`` and Megatron's private ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
   are pointed at a separate CPU ``torch.Generator`` per tracker state. The tests use dropout 0, so
   no random number is ever drawn from it; it only has to exist.

Megatron's optimizer and its micro-batch schedules still need CUDA (``device="cuda"`` literals); the
backend uses a plain AdamW without CUDA, so they are not patched.

Tests run each configuration in fresh processes (``tp_worker.py``, one per rank, on the torchrun
environment contract) because Megatron's parallel state is process-global.
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


def apply_megatron_cpu_patches() -> None:
    """Install the documented CPU replacements for Megatron's hard-coded CUDA calls (idempotent)."""
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda, "_raygym_cpu_patched", False):
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # patch 1

    # patch 2: one CPU generator stands in for "the current CUDA RNG state".
    cpu_gen = torch.Generator()

    def get_rng_state(device="cuda"):
        return cpu_gen.get_state()

    def manual_seed(seed):
        cpu_gen.manual_seed(int(seed))

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return cpu_gen.get_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        cpu_gen.set_state(new_state)

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.manual_seed = manual_seed
    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    torch.cuda._raygym_cpu_patched = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world: int, timeout: float = 240.0) -> None:
    """Start ``tp_worker.py args`` as ``world`` ranks with torchrun-style env; fail with their output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "tp_worker.py"), *args], env=env,
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
