"""Code execution as a reward: run the response's code against tests in a sandbox.

:class:`CodeReward` is a ``custom_rm_function`` (per sample; it blocks, so the reward thread pool
runs it): it takes the code from the response (the last fenced ```python block, else the whole response, after an optional fixed
``prefix`` such as ``"f=lambda x:"`` that the prompt already wrote), the tests from the sample's
label (a list of Python statements, or JSON text of one) or ``metadata["tests"]``, runs them in a
:class:`raygym.sandbox.pool.SandboxPool` (the same code on the same tests runs once: a cache) and
returns the fraction of tests passed (``all_or_nothing``:
1.0 only when every test passed). Code that times out, crashes, exhausts a limit or never defines
what the tests call scores 0 on the tests it did not pass.

``raygym.sandbox.reward:code_reward`` is an instance with the defaults (4 sandboxes, 5 CPU-seconds,
10 s wall clock, 512 MiB, 16 processes per run). Where no backend can isolate, the pool refuses to
start (naming bubblewrap) unless ``allow_weak_isolation=True``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from raygym.sandbox.harness import TestReport
from raygym.sandbox.isolation import Limits
from raygym.types import Sample

_FENCED = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(response: str, prefix: str = "") -> str:
    """The program in ``response``: the last fenced block, else the whole text; ``prefix`` goes first.

    >>> extract_code("here:\\n```python\\nx = 1\\n```\\n"), extract_code("x+1", "f=lambda x:")
    ('x = 1\\n', 'f=lambda x:x+1')
    """
    blocks = _FENCED.findall(response)
    return prefix + (blocks[-1] if blocks else response)


def sample_tests(sample: Sample) -> list[str]:
    """The tests of a sample: its label (a list, or JSON text of a list) or ``metadata["tests"]``."""
    tests: Any = sample.metadata.get("tests", sample.label)
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests) or not tests:
        raise ValueError("code reward: the sample needs tests as a non-empty list of Python statements in its label "
                         "or metadata['tests']")
    return tests


class CodeReward:
    """Reward = tests passed in a sandbox (see the module docs)."""

    def __init__(self, *, prefix: str = "", all_or_nothing: bool = False, pool_size: int = 4,
                 limits: Limits | None = None, backend: str | None = None, cache_size: int = 4096,
                 allow_weak_isolation: bool = False) -> None:
        self.prefix = prefix
        self.cache_size = cache_size  # (code, tests) -> report; generated code repeats once a policy converges
        self._cache: OrderedDict[tuple[str, tuple[str, ...]], TestReport] = OrderedDict()
        self.all_or_nothing = all_or_nothing
        self.pool_size, self.limits, self.backend = pool_size, limits or Limits(), backend
        self.allow_weak_isolation = allow_weak_isolation
        self._pool: Any = None
        self._lock = threading.Lock()

    def pool(self) -> Any:
        with self._lock:
            return self._pool_locked()

    def _pool_locked(self) -> Any:
        if self._pool is None:
            from raygym.sandbox.pool import SandboxPool

            self._pool = SandboxPool(self.pool_size, self.limits, self.backend,
                                     allow_weak_isolation=self.allow_weak_isolation)
        return self._pool

    def score_report(self, report: TestReport) -> float:
        if self.all_or_nothing:
            return 1.0 if report.passed == report.total else 0.0
        return report.fraction

    def run(self, code: str, tests: list[str]) -> TestReport:
        """The report for ``code`` on ``tests``: from the cache, else from a sandbox run."""
        key = (code, tuple(tests))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        report = self.pool().run_tests(code, tests)
        with self._lock:
            if self.cache_size:
                self._cache[key] = report
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return report

    def __call__(self, sample: Sample) -> float:
        report = self.run(extract_code(sample.response_text, self.prefix), sample_tests(sample))
        sample.metrics.update({"code_tests_passed": report.fraction, "code_tests_ran": report.ran_fraction,
                               "code_timeouts": float(report.timed_out), "code_loaded": float(report.loaded)})
        return self.score_report(report)


code_reward = CodeReward()
