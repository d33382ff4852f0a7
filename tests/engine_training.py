"""A short ``raygym train`` against a real third-party engine, run as a user runs it, and the checks every
such run must pass: it learns, and every weight sync was verified against the trainer by the probe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def installed_raygym_python(scratch: Path) -> str:
    """An interpreter with raygym installed from its wheel into a fresh venv, as users install it:
    ``RAYGYM_WHEEL_PYTHON`` (``.ci/run`` builds one with scripts/install_wheel_venv.sh), else one built under
    ``scratch`` now (about a minute)."""
    python = os.environ.get("RAYGYM_WHEEL_PYTHON")
    if python:
        return python
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install_wheel_venv.sh"), str(scratch)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def train_with_engine(flags: list[str], out: Path, timeout: float = 1400, *, python: str | None = None
                      ) -> tuple[list[dict[str, Any]], str]:
    """``python -m raygym train FLAGS --output-dir OUT`` on a private Ray; returns the metrics rows and the
    engine's server log (the run must succeed). With ``python`` (an installed raygym, see
    :func:`installed_raygym_python`), the run starts outside the checkout, so raygym comes from that install."""
    ray_tmp = tempfile.mkdtemp(prefix="rge-", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp, "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    cwd = REPO_ROOT
    if python is not None:
        env.pop("PYTHONPATH", None)
        cwd = out.parent
        cwd.mkdir(parents=True, exist_ok=True)
    try:
        run = subprocess.run([python or sys.executable, "-m", "raygym", "train", *flags, "--output-dir", str(out)],
                             cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, (out / "logs" / "server-0.log").read_text()


def assert_learns_with_probe_verified_syncs(rows: list[dict[str, Any]], steps: int) -> None:
    """``steps`` rows; the mean reward of the last 10 steps at least 0.15 above the first 10; every sync's
    version reported and its probe run within the default tolerance."""
    assert len(rows) == steps
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.15, f"mean reward first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    for r in rows:  # every sync was checked against the trainer, none silently unverified
        assert r["sync/verified_versions"] == 1.0 and r["sync/probe_tokens"] > 0, r
        assert r["sync/probe_logprob_diff_mean"] <= 0.1
