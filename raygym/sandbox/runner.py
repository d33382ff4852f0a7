"""Run untrusted Python in a sandbox: one program (:meth:`Sandbox.run`), or a candidate graded by
tests in a separate grader process (:meth:`Sandbox.run_graded`, used by
:func:`raygym.sandbox.harness.run_tests`).

:class:`Sandbox` owns two unprivileged uids when it runs as root (one for the candidate, one for its
grader; claimed with lock files, so two sandboxes never share one, also across processes) and a
memory cgroup where the machine offers one (:mod:`raygym.sandbox.memcg`). It runs one program at a
time inside the namespaces of :mod:`raygym.sandbox.isolation`, enforces the wall-clock timeout by
killing the process groups, and afterwards kills whatever process of its uids is left (so nothing a
run started outlives it).

>>> box = Sandbox()                                      # doctest: +SKIP
>>> box.run("print(6 * 7)").stdout                       # doctest: +SKIP
'42\\n'
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import threading
import time

from raygym.errors import RaygymError
from raygym.sandbox import programs
from raygym.sandbox.isolation import (
    LOCK_DIR,
    PROBE_UID,
    WEAK_BACKEND,
    Limits,
    detect_backend,
    encode_source,
    python_executable,
    stage_call,
    start_sandboxed,
)
from raygym.sandbox.memcg import MemoryCgroup, cgroup_name
from raygym.sandbox.process import Child, RunResult, kill_processes_of, kill_until_gone, processes_of

__all__ = ["GRACE_SECONDS", "UID_RANGE", "RunResult", "Sandbox", "detect_backend", "grader_limits", "processes_of"]

UID_RANGE = range(61000, 61512)
GRACE_SECONDS = 0.5  # how long a candidate may take to exit once its grader is done


def _claim_uid(exclude: tuple[int, ...] = ()) -> tuple[int, int]:
    """(uid, lock fd): the first uid of UID_RANGE whose lock file no live process holds."""
    LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
    for uid in UID_RANGE:
        if uid in exclude:
            continue
        fd = os.open(LOCK_DIR / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise RaygymError(f"every sandbox uid in {UID_RANGE.start}..{UID_RANGE.stop - 1} is in use; end other sandboxes")


class Sandbox:
    """One isolated runner. ``backend``: ``bwrap`` | ``unshare`` | None (the first that works) |
    ``weak`` (no namespaces: only with ``allow_weak_isolation``, see :mod:`raygym.sandbox.isolation`).

    Run as root it claims its own uids (so the process limit and the final clean-up cover exactly its
    processes) and a memory cgroup when the machine has one; otherwise it runs as the current user.
    ``memory_bound`` says how memory is bounded.
    """

    def __init__(self, limits: Limits | None = None, backend: str | None = None,
                 allow_weak_isolation: bool = False) -> None:
        self.limits = limits or Limits()
        self._locks: list[int] = []
        self.cgroup: MemoryCgroup | None = None
        as_root = os.geteuid() == 0
        if as_root:
            self.uid, lock = _claim_uid(exclude=(PROBE_UID,))
            self._locks.append(lock)
            self.grader_uid, lock = _claim_uid(exclude=(PROBE_UID, self.uid))
            self._locks.append(lock)
        else:
            self.uid = self.grader_uid = os.geteuid()
        self._user = self.uid if as_root else None
        self._grader_user = self.grader_uid if as_root else None
        try:
            self.backend = detect_backend(backend, as_root, allow_weak_isolation)
            self.cgroup = MemoryCgroup.create(cgroup_name(self.uid), self.limits.memory_bytes)
        except BaseException:
            self.close()
            raise
        self.python = python_executable()
        self._cgroup_limit = self.limits.memory_bytes
        self._serial = threading.Lock()  # one run at a time: the clean-up kills every process of the uids

    @property
    def memory_bound(self) -> str:
        """How this sandbox bounds memory, in words."""
        files = ("no private file system (weak isolation)" if self.backend == WEAK_BACKEND else
                 "sized tmpfs (/tmp, /dev/shm) counted in the budget")
        if self.cgroup is not None:
            return f"{self.cgroup.description}: every process and file together; {files}"
        return f"per-process address space (RLIMIT_AS), no memory cgroup available here; {files}"

    def close(self) -> None:
        """Release the uids and the cgroup (idempotent)."""
        if self.cgroup is not None:
            kill_processes_of(self._uids())
            try:
                self.cgroup.remove()
            except OSError:
                pass
            self.cgroup = None
        for fd in self._locks:
            os.close(fd)
        self._locks = []

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _uids(self) -> tuple[int, ...]:
        return tuple(u for u in {self._user, self._grader_user} if u is not None)

    def _prepare(self, limits: Limits) -> Limits:
        """The limits to start a run with. RLIMIT_NPROC counts every process of the real uid: run as an
        ordinary user, the user's processes so far come on top."""
        if self.cgroup is not None and limits.memory_bytes != self._cgroup_limit:
            self.cgroup.limit(limits.memory_bytes)
            self._cgroup_limit = limits.memory_bytes
        if self._user is None:
            limits = dataclasses.replace(limits, processes=limits.processes + len(processes_of(self.uid)))
        return limits

    def run(self, source: str, limits: Limits | None = None) -> RunResult:
        """Run the Python program ``source`` (after the backend's stage) and return its output."""
        limits = limits or self.limits
        with self._serial:
            limits = self._prepare(limits)
            child = start_sandboxed(self.backend, limits, programs.run_program(stage_call(self.backend, limits)),
                                    encode_source(source), uid=self._user, cgroup=self.cgroup)
            try:
                child.feed()
                finished = child.wait(limits.wall_seconds)
            finally:
                child.kill()
            return child.result(timed_out=not finished, leftovers=self._clean_up())

    def run_graded(self, code: str, tests_payload: bytes, limits: Limits | None = None) -> tuple[RunResult, RunResult]:
        """Run ``code`` as the candidate and the grader (fed ``tests_payload``) beside it, connected by two
        pipes; returns (candidate, grader) results. The grader runs in a sandbox of its own (the tests
        are trusted, but the values they handle come from the candidate) with a uid of its own (as
        root): the candidate can neither see nor signal it."""
        limits = limits or self.limits
        with self._serial:
            limits = self._prepare(limits)
            request_r, request_w = os.pipe()  # grader -> candidate
            reply_r, reply_w = os.pipe()  # candidate -> grader
            children: list[Child] = []
            try:
                program = programs.candidate_program(stage_call(self.backend, limits), request_r, reply_w,
                                                     limits.message_bytes)
                children.append(start_sandboxed(self.backend, limits, program, encode_source(code), uid=self._user,
                                                cgroup=self.cgroup, pass_fds=(request_r, reply_w)))
                judge = grader_limits(limits)
                program = programs.grader_program(stage_call(self.backend, judge), request_w, reply_r,
                                                  limits.message_bytes, undumpable=self._user is None)
                children.append(start_sandboxed(self.backend, judge, program, tests_payload, uid=self._grader_user,
                                                cgroup=None, pass_fds=(request_w, reply_r)))
            except BaseException:
                for child in children:
                    child.kill()
                raise
            finally:
                for fd in (request_r, request_w, reply_r, reply_w):
                    os.close(fd)
            candidate, grader = children
            try:
                candidate.feed()
                grader.feed()
                deadline = candidate.started + limits.wall_seconds
                graded = grader.wait(deadline - time.monotonic())
                if graded:  # the verdicts are in; the candidate exits at the end of its channel
                    candidate.wait(min(GRACE_SECONDS, deadline - time.monotonic()))
            finally:
                grader.kill()
                candidate.kill()
            leftovers = self._clean_up()
            return (candidate.result(timed_out=not graded, leftovers=leftovers),
                    grader.result(timed_out=not graded, leftovers=leftovers))

    def _clean_up(self) -> int:
        """Kill what a run left: the candidate's processes (all in its cgroup, which they cannot leave, when
        there is one; else every process of its uids)."""
        if self.cgroup is not None:
            return kill_until_gone(self.cgroup.pids)
        return kill_processes_of(self._uids())

def grader_limits(limits: Limits) -> Limits:
    """The grader's own limits: it runs only the tests and decodes the candidate's answers (each at most
    ``message_bytes``, which may decode to many times that), with the run's CPU time."""
    return Limits(cpu_seconds=limits.cpu_seconds + 1, wall_seconds=limits.wall_seconds,
                  memory_bytes=max(1024 ** 3, 32 * limits.message_bytes), tmp_bytes=1024 * 1024,
                  processes=limits.processes, open_files=32, output_bytes=limits.output_bytes,
                  message_bytes=limits.message_bytes)


