"""What isolation and an out-of-reach grader cost: one honest graded run of a small program.

Figure, per backend: seconds per ``raygym.sandbox.run_tests`` (the candidate in the sandbox, the tests
in a separate grader process). Baselines, measured in the same run and interleaved with it (the same
repetition runs every mode back to back, so load drift cancels in the paired ratios):

- ``single``: the former design, the candidate and its tests in ONE sandboxed interpreter that prints
  nonce-tagged verdict lines (forgeable from inside; kept here only as the yardstick), run through
  the same sandbox (same namespaces, limits, seccomp, cgroup);
- ``plain``: that same program as a plain ``python3 -I -S -c`` subprocess (no isolation at all).

Prints one JSON line per backend. Run: ``raygym bench sandbox [--runs 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from raygym.sandbox import Sandbox, SandboxUnavailable, run_tests
from raygym.sandbox.isolation import python_executable

CODE = "def f(x):\n    return x * 2\n"
TESTS = [f"assert f({i}) == {2 * i}" for i in range(10)]

# The former harness: tests run in the candidate's interpreter, verdicts are nonce-tagged stdout lines.
FORMER_PROGRAM = """
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
NONCE = "0123456789abcdef0123456789abcdef"


def former_program() -> str:
    return FORMER_PROGRAM.format(payload=json.dumps({"code": CODE, "tests": TESTS}), nonce=NONCE)


def former_passed(stdout: str) -> int:
    return sum(line.startswith(f"{NONCE} PASS ") for line in stdout.splitlines())


def timed(fn, check) -> float:
    start = time.perf_counter()
    outcome = fn()
    seconds = time.perf_counter() - start
    assert check(outcome), outcome
    return seconds


def measure(backend: str, runs: int) -> dict[str, list[float]]:
    program = former_program()
    plain_argv = [python_executable(), "-I", "-S", "-c", program]
    times: dict[str, list[float]] = {"graded": [], "single": [], "plain": []}
    with Sandbox(backend=backend) as box:
        run_tests(box, CODE, TESTS)  # warm up (the first cgroup move is slow)
        for _ in range(runs):
            times["graded"].append(timed(lambda: run_tests(box, CODE, TESTS), lambda r: r.passed == len(TESTS)))
            times["single"].append(timed(lambda: box.run(program), lambda r: former_passed(r.stdout) == len(TESTS)))
            times["plain"].append(timed(lambda: subprocess.run(plain_argv, capture_output=True, text=True),
                                        lambda r: former_passed(r.stdout) == len(TESTS)))
        times["memory_bound"] = box.memory_bound  # type: ignore[assignment]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    machine = {"cores": os.cpu_count(), "device": "cpu", "platform": platform.platform()}
    for backend in ("bwrap", "unshare"):
        try:
            times = measure(backend, args.runs)
        except SandboxUnavailable as exc:
            print(json.dumps({"figure": f"sandbox_{backend}_graded_run_s", "skipped": str(exc)}))
            continue
        graded, single, plain = (statistics.median(times[k]) for k in ("graded", "single", "plain"))
        paired = statistics.median(g / s for g, s in zip(times["graded"], times["single"], strict=True))
        print(json.dumps({
            "figure": f"sandbox_{backend}_graded_run_s", "value": round(graded, 4),
            "baseline": "single_process_harness_run_s", "baseline_value": round(single, 4),
            "ratio": round(graded / single, 2), "paired_median_ratio": round(paired, 2),
            "plain_subprocess_run_s": round(plain, 4), "ratio_vs_plain": round(graded / plain, 2),
            "memory_bound": times["memory_bound"], "runs": args.runs, "machine": machine}))


if __name__ == "__main__":
    main()
