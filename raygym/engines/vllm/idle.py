"""vLLM's workers without the busy second after each batch. Runs in vLLM's worker processes.

A vLLM worker reads its scheduler's batches from a shared-memory queue; after every read it keeps polling that
queue with ``sched_yield`` for ``busy_loop_s`` (1 s in vLLM 0.32's ``SpinCondition``) before it sleeps on the queue's
zmq notification. Serving, that saves a wake-up per decode step; in RL the batch ends and the trainer starts on
the same cores, which on a CPU machine then lose a whole core for that second (measured: a tiny step's training
phase took 1.0 s with vLLM as the engine against 0.044 s with raygym's server, the worker at 98% of a core for the
first second after each batch). The adapter asks for a shorter spin on CPU through :data:`READER_SPIN_ENV`; decode
steps, which follow each other within milliseconds, keep spinning.
"""

from __future__ import annotations

import functools
import os
from typing import Any

READER_SPIN_ENV = "RAYGYM_VLLM_READER_SPIN_S"  # seconds a worker polls its batch queue after a read (unset: vLLM's)


def bound_reader_spin(seconds: float) -> bool:
    """Readers of vLLM's shared-memory queues made from now on poll for at most ``seconds`` after a read; False
    when this vLLM has no such setting (another release: nothing to bound)."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    spin_condition: Any = getattr(shm_broadcast, "SpinCondition", None)
    if spin_condition is None or getattr(spin_condition, "_raygym_bounded", False):
        return spin_condition is not None
    init = spin_condition.__init__

    @functools.wraps(init)
    def bounded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            self.busy_loop_s = min(self.busy_loop_s, seconds)

    spin_condition.__init__ = bounded
    spin_condition._raygym_bounded = True
    return True


def bound_reader_spin_from_env() -> bool:
    """:func:`bound_reader_spin` with :data:`READER_SPIN_ENV`'s seconds, when the adapter set it."""
    value = os.environ.get(READER_SPIN_ENV)
    return bound_reader_spin(float(value)) if value else False
