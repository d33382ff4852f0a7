"""Scoring code by tests, with the verdict out of the candidate's reach.

The candidate code runs in the sandbox (:mod:`raygym.sandbox.candidate`); each test (a Python
statement, e.g. ``assert f(2) == 4``) runs in a separate grader process
(:mod:`raygym.sandbox.grader`, in a sandbox of its own) that the candidate cannot see, signal, trace
or write to, and that takes nothing from the candidate but plain values (:mod:`raygym.sandbox.wire`). The verdicts are
the grader's lines on its own stdout, read here; nothing the candidate prints, imports, patches or
inspects reaches them, and the tests' expected values never enter the candidate's process. A run
that times out keeps the verdicts the grader gave before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raygym.sandbox import wire
from raygym.sandbox.process import RunResult
from raygym.sandbox.runner import Sandbox


@dataclass
class TestReport:
    """Which tests passed, and how the run ended."""

    passed: int
    total: int
    failed: int  # tests that ran and whose assertion failed (the others raised another error or never ran)
    loaded: bool  # the candidate code itself ran without an exception (as the candidate reported it)
    load_error: str | None  # the exception type that stopped it (e.g. MemoryError), or "exited"
    timed_out: bool
    exit_code: int | None  # the candidate's
    stderr_tail: str = ""  # the candidate's
    grader_error: str = ""  # the grader's stderr when it stopped before its last line (killed, crashed)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def ran_fraction(self) -> float:
        """Tests whose code ran to its assertion (passed or failed), without another exception."""
        return (self.passed + self.failed) / self.total if self.total else 0.0


def read_report(grader: RunResult, candidate: RunResult, total: int) -> TestReport:
    """The report from the grader's verdict lines (see :mod:`raygym.sandbox.grader`)."""
    passed: set[int] = set()
    failed: set[int] = set()
    load_error = None
    loaded = False
    lines = grader.stdout.splitlines()
    for line in lines:
        parts = line.split(" ")
        if parts[0] in ("PASS", "FAIL") and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) < total:
            (passed if parts[0] == "PASS" else failed).add(int(parts[1]))
        elif parts[0] == "LOADED":
            loaded = True
        elif parts[0] == "LOAD" and len(parts) == 2:
            load_error = parts[1]
    return TestReport(passed=len(passed), total=total, failed=len(failed - passed), loaded=loaded,
                      load_error=load_error, timed_out=candidate.timed_out, exit_code=candidate.exit_code,
                      stderr_tail=candidate.stderr[-500:],
                      grader_error="" if lines[-1:] == ["DONE"] else f"exit {grader.exit_code}: {grader.stderr[-500:]}")


def run_tests(sandbox: Sandbox, code: str, tests: Sequence[str]) -> TestReport:
    """Run ``code`` in ``sandbox`` and each of ``tests`` in its grader; count the tests that passed."""
    candidate, grader = sandbox.run_graded(code, wire.dumps(list(tests)))
    return read_report(grader, candidate, len(tests))
