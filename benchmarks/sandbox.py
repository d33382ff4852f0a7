"""What isolation costs: one sandboxed run of a small test program vs the same program as a plain
subprocess (no namespaces, no limits, no uid change).

Figure: seconds per run through ``raygym.sandbox.run_tests`` (bubblewrap, or unshare when it is
missing); baseline, measured in the same run: ``python3 -I -S -c PROGRAM`` with the same program on
stdin-free argv. Prints one JSON line per backend with the ratio. Run:
``python benchmarks/sandbox.py [--runs 30]``.
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
from raygym.sandbox.harness import build_program
from raygym.sandbox.isolation import python_executable

CODE = "def f(x):\n    return x * 2\n"
TESTS = [f"assert f({i}) == {2 * i}" for i in range(10)]


def plain_seconds(runs: int) -> list[float]:
    program = build_program(CODE, TESTS, "bench")
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([python_executable(), "-I", "-S", "-c", program], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def sandbox_seconds(backend: str, runs: int) -> list[float]:
    times = []
    with Sandbox(backend=backend) as box:
        for _ in range(runs):
            start = time.perf_counter()
            report = run_tests(box, CODE, TESTS)
            times.append(time.perf_counter() - start)
            assert report.passed == len(TESTS), report
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    baseline = statistics.median(plain_seconds(args.runs))
    machine = {"cores": os.cpu_count(), "device": "cpu", "platform": platform.platform()}
    for backend in ("bwrap", "unshare"):
        try:
            figure = statistics.median(sandbox_seconds(backend, args.runs))
        except SandboxUnavailable as exc:
            print(json.dumps({"figure": f"sandbox_{backend}_run_s", "skipped": str(exc)}))
            continue
        print(json.dumps({"figure": f"sandbox_{backend}_run_s", "value": round(figure, 4),
                          "baseline": "plain_subprocess_run_s", "baseline_value": round(baseline, 4),
                          "ratio": round(figure / baseline, 2), "runs": args.runs, "machine": machine}))


if __name__ == "__main__":
    main()
