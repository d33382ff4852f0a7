"""Sandboxed execution of generated code (namespaces, seccomp, resource limits, a pool of Ray actors),
graded by tests in a separate process, and the code-execution reward built on it.

>>> score_code("def f(x):\\n    return x + 1\\n", ["assert f(1) == 2", "assert f(2) == 4"])  # doctest: +SKIP
0.5
>>> run_code("import socket; socket.create_connection(('127.0.0.1', 22))").exit_code  # doctest: +SKIP
1
"""

from __future__ import annotations

from collections.abc import Sequence

from raygym.sandbox.harness import TestReport, run_tests
from raygym.sandbox.isolation import Limits, SandboxUnavailable, detect_backend
from raygym.sandbox.process import RunResult
from raygym.sandbox.runner import Sandbox


def run_code(source: str, limits: Limits | None = None, backend: str | None = None,
             allow_weak_isolation: bool = False) -> RunResult:
    """Run the Python program ``source`` once in a fresh sandbox (its exit code, output, timeout)."""
    with Sandbox(limits, backend, allow_weak_isolation) as sandbox:
        return sandbox.run(source)


def score_code(code: str, tests: Sequence[str], limits: Limits | None = None, backend: str | None = None,
               allow_weak_isolation: bool = False) -> float:
    """The fraction of ``tests`` (Python statements, graded in a separate process against ``code``) that
    pass in a fresh sandbox; 0.0 for code that fails, hangs, or exhausts a limit before passing any."""
    with Sandbox(limits, backend, allow_weak_isolation) as sandbox:
        return run_tests(sandbox, code, tests).fraction


__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable", "TestReport", "detect_backend", "run_code",
           "run_tests", "score_code"]
