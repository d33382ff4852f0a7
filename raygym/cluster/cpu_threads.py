"""CPU cores and torch threads of raygym's processes: one thread of a process spreads torch's CPU work over the
process's cores, every other thread runs its torch work alone; trainer ranks and engines that compute at the
same time get disjoint cores (:func:`split_cores`, :func:`pin_process`), as they get disjoint GPUs.

Why: libgomp, the OpenMP runtime of torch's CPU wheels, gives each thread that opens a parallel region a team
of its own, kept for as long as that thread lives. Once a process holds more OpenMP threads than it has cores,
libgomp stops letting idle team threads spin between parallel regions (its throttled spin count, about 100
spins): they sleep, and every region pays a futex wake-up. A decode step opens hundreds of short regions.
Measured on 2 cores (raygym's server, a 10.6M-parameter model, 128 rows x 64 tokens): 2.5 s per rollout, and
4.2 s once two helper threads (the weight receiver's) had each run one parallel copy; with those helpers kept
serial, 2.5 s again. Inside a training run that was every rollout after the first weight sync.

So a process that computes on one thread makes one thread the default (:func:`make_serial_default`, before
its helper threads first use torch: weight-sync receivers and encoders, executors, ``asyncio.to_thread``), and
its compute thread claims the cores for itself (:func:`claim_torch_threads`: OpenMP's and MKL's thread counts
are per thread). A trainer rank computes on the thread that sets it up and calls :func:`dedicate_torch_threads`,
both at once; raygym's server makes the default in its main thread and claims in its generation thread. Where
the OpenMP runtime cannot be reached (not Linux, another runtime), claiming falls back to
``torch.set_num_threads(n)`` for the whole process, as before.

For example, in a process of its own (it changes the process's torch settings)::

    dedicate_torch_threads(2)  # this thread: 2; any thread that starts its torch work later: 1
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class _Runtime:
    """The per-thread thread-count setters of the OpenMP runtime and of MKL loaded in this process."""

    omp_set_num_threads: ctypes._CFuncPtr  # type: ignore[name-defined]
    mkl_set_num_threads_local: ctypes._CFuncPtr | None  # type: ignore[name-defined]


def _loaded_library(stem: str) -> str | None:
    """The path of the first shared library mapped into this process whose file name starts with ``stem``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
        if len(fields) == 6 and fields[5].startswith("/") and Path(fields[5]).name.startswith(stem):
            return fields[5]
    return None


@functools.cache
def _runtime() -> _Runtime | None:
    torch.get_num_threads()  # loads torch's CPU library (and its OpenMP runtime) if nothing has yet
    omp_path = _loaded_library("libgomp")
    if omp_path is None:
        return None
    try:
        omp_set = ctypes.CDLL(omp_path).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    omp_set.argtypes, omp_set.restype = [ctypes.c_int], None
    mkl_local = None
    torch_cpu = _loaded_library("libtorch_cpu")
    if torch_cpu is not None:
        try:
            # the C entry point: the lower-case symbol is Fortran's, which takes its argument by pointer
            mkl_local = ctypes.CDLL(torch_cpu).MKL_Set_Num_Threads_Local
            mkl_local.argtypes, mkl_local.restype = [ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):  # a build without MKL (OpenBLAS follows OpenMP's count)
            mkl_local = None
    return _Runtime(omp_set, mkl_local)


def claim_torch_threads(n: int) -> int:
    """Run the calling thread's torch CPU work on ``n`` threads whatever the process default; returns the
    count the thread now has. Without a reachable OpenMP runtime: ``torch.set_num_threads(n)`` (every thread).
    """
    if n < 1:
        raise ValueError(f"claim_torch_threads({n}): a thread count is at least 1")
    torch.get_num_threads()  # torch sets a thread's OpenMP count from the process default at its first use
    runtime = _runtime()
    if runtime is None:
        torch.set_num_threads(n)
    else:
        runtime.omp_set_num_threads(n)
        if runtime.mkl_set_num_threads_local is not None:
            runtime.mkl_set_num_threads_local(n)
    return torch.get_num_threads()


def make_serial_default() -> bool:
    """One torch thread for the calling thread and for every thread that first uses torch after this call;
    False (nothing changed) where threads cannot claim more for themselves (:func:`claim_torch_threads`)."""
    if _runtime() is None:
        return False
    torch.set_num_threads(1)
    return True


def dedicate_torch_threads(n: int) -> int:
    """The calling thread computes on ``n`` threads, threads that start their torch work later on one
    (:func:`make_serial_default`, then :func:`claim_torch_threads`); returns the calling thread's count."""
    make_serial_default()
    return claim_torch_threads(n)


@dataclass(frozen=True)
class CoreSplit:
    """A node's cores split as GPUs are: each local trainer rank its own consecutive slice, the engines the
    last cores (shared by the node's engines, one thread each)."""

    trainer: tuple[tuple[int, ...], ...]
    engines: tuple[int, ...]


def split_cores(cores: Sequence[int], engine_cores: int, trainer_ranks: int) -> CoreSplit | None:
    """``cores`` split between ``trainer_ranks`` trainer ranks and engines that decode on ``engine_cores``
    cores meanwhile; None when there are too few cores for every rank and the engines to have their own.

    >>> split_cores([0, 1], engine_cores=1, trainer_ranks=1)
    CoreSplit(trainer=((0,),), engines=(1,))
    >>> split_cores(range(16), engine_cores=4, trainer_ranks=2).trainer
    ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11))
    >>> split_cores([0, 1], engine_cores=2, trainer_ranks=1) is None
    True
    """
    ordered = sorted(cores)
    if engine_cores < 1 or trainer_ranks < 1 or len(ordered) < engine_cores + trainer_ranks:
        return None
    rest, per = ordered[:-engine_cores], (len(ordered) - engine_cores) // trainer_ranks
    return CoreSplit(tuple(tuple(rest[i * per : (i + 1) * per]) for i in range(trainer_ranks)),
                     tuple(ordered[-engine_cores:]))


def pin_process(cores: Sequence[int]) -> None:
    """Run every thread of this process, and every thread it starts later, on ``cores`` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
