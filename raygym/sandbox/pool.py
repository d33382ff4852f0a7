"""A pool of sandbox Ray actors: each owns one :class:`raygym.sandbox.runner.Sandbox` (one uid, one run
at a time); :class:`SandboxPool` hands each request to a free actor.

>>> pool = SandboxPool(size=4)                                             # doctest: +SKIP
>>> report = pool.run_tests("f=lambda x:x+1", ["assert f(1)==2"])    # doctest: +SKIP
>>> report.fraction                                                         # doctest: +SKIP
1.0
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

from raygym.sandbox.harness import TestReport, run_tests
from raygym.sandbox.isolation import Limits
from raygym.sandbox.runner import Sandbox


class SandboxActor:
    """Ray actor body: one sandbox; ``run_tests`` runs one candidate at a time."""

    def __init__(self, limits: Limits | None = None, backend: str | None = None,
                 allow_weak_isolation: bool = False) -> None:
        self.sandbox = Sandbox(limits, backend, allow_weak_isolation)

    def info(self) -> dict[str, Any]:
        return {"uid": self.sandbox.uid, "backend": self.sandbox.backend, "memory_bound": self.sandbox.memory_bound}

    def run_tests(self, code: str, tests: Sequence[str]) -> TestReport:
        return run_tests(self.sandbox, code, tests)

    def close(self) -> None:
        self.sandbox.close()


class SandboxPool:
    """``size`` :class:`SandboxActor` s, started on first use in the calling process's Ray. Thread-safe and
    blocking (reward functions run in a thread pool): a request waits for a free actor."""

    def __init__(self, size: int = 4, limits: Limits | None = None, backend: str | None = None,
                 num_cpus: float = 0.0, allow_weak_isolation: bool = False) -> None:
        if size < 1:
            raise ValueError(f"size={size}: a sandbox pool needs at least one actor")
        self.size, self.limits, self.backend, self.num_cpus = size, limits, backend, num_cpus
        self.allow_weak_isolation = allow_weak_isolation
        self._actors: list[Any] = []
        self._free: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self.runs = 0
        self.timeouts = 0

    def _start(self) -> None:
        with self._lock:
            if self._actors:
                return
            import ray

            cls = ray.remote(num_cpus=self.num_cpus)(SandboxActor)
            actors = [cls.remote(self.limits, self.backend, self.allow_weak_isolation) for _ in range(self.size)]
            ray.get([a.info.remote() for a in actors])  # type: ignore[attr-defined]  # surfaces SandboxUnavailable now
            self._actors = actors
            for actor in actors:
                self._free.put(actor)

    def run_tests(self, code: str, tests: Sequence[str]) -> TestReport:
        """Run ``code`` and ``tests`` on the next free sandbox (blocks until one is free)."""
        import ray

        self._start()
        actor = self._free.get()
        try:
            report = ray.get(actor.run_tests.remote(code, list(tests)))
        finally:
            self._free.put(actor)
        with self._lock:
            self.runs += 1
            self.timeouts += int(report.timed_out)
        return report

    def shutdown(self) -> None:
        """Close the sandboxes (their uids and cgroups; their processes are gone after every run), then
        kill the actors. A sandbox an actor could not close leaves an empty cgroup, which the next
        sandbox on the machine removes."""
        import ray

        with self._lock:
            try:
                ray.get([actor.close.remote() for actor in self._actors], timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            self._actors, self._free = [], queue.Queue()
