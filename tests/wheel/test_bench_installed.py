"""``raygym bench`` from an installed raygym: its wheel in a fresh venv, run from a user's directory outside the
checkout (the benchmarks ship in the package), with ``--out``: the JSON lines on stdout, results.jsonl, and
report.html with its charts embedded.

Two quick benchmarks with small arguments: ``train_step`` (a ratio against its same-run baseline, no Ray) and
``e2e`` on the tiny model, sync only (Ray started by the install; rows split by phase)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
PNG = b"\x89PNG\r\n\x1a\n"


def bench(wheel_python: str, env: dict[str, str], cwd: Path, *args: str) -> tuple[list[dict], str]:
    """``<venv>/bin/raygym bench ARGS`` in ``cwd``; (the JSON rows it printed, its stderr). It must succeed."""
    raygym = Path(wheel_python).parent / "raygym"
    done = subprocess.run([str(raygym), "bench", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return rows, done.stderr


def charts(report: Path) -> list[bytes]:
    """The PNGs embedded in a report."""
    return [base64.b64decode(b) for b in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", report.read_text())]


def test_installed_bench_lists_and_runs_train_step_with_a_report(wheel_python, user_env, tmp_path):
    user_dir = tmp_path / "my-project"  # outside the checkout: nothing imports from the source tree
    user_dir.mkdir()
    listed = subprocess.run([str(Path(wheel_python).parent / "raygym"), "bench", "--list"], cwd=user_dir,
                            env=user_env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert {"e2e", "async", "train_step", "weight_sync"} <= {line.split()[0] for line in listed.stdout.splitlines()}

    out = tmp_path / "out"
    rows, err = bench(wheel_python, user_env, user_dir, "train_step", "--repeats", "1", "--samples", "16",
                      "--out", str(out))
    assert rows and all(isinstance(r.get("ratio"), float) and r["ratio"] > 0 for r in rows), rows
    assert {r["figure"] for r in rows} == {"train_tokens_per_s_dynamic_batching"}
    assert "running train_step" in err and "finished after" in err
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == rows
    pngs = charts(out / "report.html")
    assert len(pngs) == 1 and pngs[0].startswith(PNG)  # the ratios; train_step splits nothing by phase
    run = json.loads((out / "run.json").read_text())
    assert run["exit"] == 0 and run["command"].startswith("raygym bench train_step --repeats 1")


def test_installed_bench_runs_e2e_on_ray_and_charts_its_phases(wheel_python, user_env, tmp_path):
    out = tmp_path / "out"
    rows, err = bench(wheel_python, user_env, tmp_path, "e2e", "--steps", "2", "--warmup", "1", "--models", "tiny",
                      "--modes", "sync", "--out", str(out))
    assert [r["figure"] for r in rows] == ["raygym_step_split_sync"], rows
    split = rows[0]
    assert split["step_s"] > 0 and split["train_s"] > 0 and split["rollout_s"] > 0
    assert split["setup"]["model"] == "tiny" and split["machine"]["cores"]
    assert "TRL figures skipped" in err
    pngs = charts(out / "report.html")
    assert len(pngs) == 1 and pngs[0].startswith(PNG)  # the phases; a sync-only run has no ratio
    assert "Time by phase" in (out / "report.html").read_text()
