"""Scoring code by tests: the program the sandbox runs, and how its output is read.

The sandboxed program executes the candidate code, then each test (a Python statement, e.g.
``assert f(2) == 4``) in the candidate's namespace, and prints one line per test that passed (or
whose assertion failed: the code ran but gave a wrong value), prefixed with a per-run random nonce. Only lines with the nonce count, so text the candidate prints
cannot pass a test; a run that times out or is killed keeps the passes it printed before.

(The nonce is in the interpreter's memory, so code written to search that memory could forge a
line; the process isolation, not the nonce, is what protects the host.)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from raygym.sandbox.runner import RunResult, Sandbox

_PROGRAM = """
import json as _json, sys as _sys
_spec = _json.loads({payload!r})
_out = _sys.stdout
_ns = {{"__name__": "__candidate__"}}
try:
    exec(compile(_spec["code"], "<candidate>", "exec"), _ns)
except BaseException as _exc:
    _out.write("{nonce} LOAD " + type(_exc).__name__ + "\\n"); _out.flush(); raise SystemExit(1)
for _i, _test in enumerate(_spec["tests"]):
    try:
        exec(compile(_test, "<test>", "exec"), _ns)
    except AssertionError:
        _out.write("{nonce} FAIL " + str(_i) + "\\n"); _out.flush()
        continue
    except BaseException:
        continue
    _out.write("{nonce} PASS " + str(_i) + "\\n"); _out.flush()
"""


@dataclass
class TestReport:
    """Which tests passed, and how the run ended."""

    passed: int
    total: int
    failed: int  # tests that ran and whose assertion failed (the others raised another error or never ran)
    loaded: bool  # the candidate code itself ran without an exception
    load_error: str | None  # the exception type that stopped it (e.g. MemoryError)
    timed_out: bool
    exit_code: int | None
    stderr_tail: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def ran_fraction(self) -> float:
        """Tests whose code ran to its assertion (passed or failed), without another exception."""
        return (self.passed + self.failed) / self.total if self.total else 0.0


def build_program(code: str, tests: Sequence[str], nonce: str) -> str:
    """The sandboxed program for ``code`` and ``tests``."""
    payload = json.dumps({"code": code, "tests": list(tests)})
    return _PROGRAM.format(payload=payload, nonce=nonce)


def read_report(result: RunResult, total: int, nonce: str) -> TestReport:
    passed: set[int] = set()
    failed: set[int] = set()
    load_error = None
    for line in result.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != nonce:
            continue
        if parts[1] in ("PASS", "FAIL") and parts[2].isdigit() and int(parts[2]) < total:
            (passed if parts[1] == "PASS" else failed).add(int(parts[2]))
        elif parts[1] == "LOAD":
            load_error = parts[2]
    loaded = load_error is None and (bool(passed) or result.ok)
    return TestReport(passed=len(passed), total=total, failed=len(failed - passed), loaded=loaded,
                      load_error=load_error,
                      timed_out=result.timed_out, exit_code=result.exit_code, stderr_tail=result.stderr[-500:])


def run_tests(sandbox: Sandbox, code: str, tests: Sequence[str]) -> TestReport:
    """Run ``code`` then each of ``tests`` in ``sandbox``; count the tests that passed."""
    nonce = secrets.token_hex(16)
    result = sandbox.run(build_program(code, tests, nonce))
    return read_report(result, len(tests), nonce)
