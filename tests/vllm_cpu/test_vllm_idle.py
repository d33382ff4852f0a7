"""raygym's bound on vLLM's post-batch spin (raygym/engines/vllm/idle.py), against vLLM's own class in its
interpreter: a worker's batch-queue reader made after the bound polls for the adapter's seconds, not vLLM's one
second, and the writer side is left as vLLM made it. The CPU this saves per training step is a figure of
raygym/bench/engine_step.py, not a test."""

from __future__ import annotations

import subprocess

import pytest

from raygym.engines.actor import raygym_import_root

pytestmark = pytest.mark.vllm_cpu

PROBE = """
import os, zmq
os.environ["RAYGYM_VLLM_READER_SPIN_S"] = "0.05"
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
context = zmq.Context()
before = SpinCondition(is_reader=True, context=context, notify_address="inproc://raygym-before").busy_loop_s
from raygym.engines.vllm.idle import bound_reader_spin_from_env
assert bound_reader_spin_from_env() and bound_reader_spin_from_env()  # idempotent
reader = SpinCondition(is_reader=True, context=context, notify_address="inproc://raygym-after")
writer = SpinCondition(is_reader=False, context=context, notify_address="inproc://raygym-writer")
print(before, reader.busy_loop_s, writer.busy_loop_s)
"""


def test_a_worker_reader_spins_for_the_bound_not_vllms_second(vllm_python):
    done = subprocess.run([vllm_python, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": raygym_import_root(vllm_python), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    before, after, writer = (float(x) for x in done.stdout.split()[-3:])
    assert before >= 0.5 and after == 0.05 and writer == 0.0, done.stdout
