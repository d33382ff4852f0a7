"""The local Ray a run starts for itself keeps token auth with a private token: no token file in the
home directory, no warning, tasks run; the environment is restored afterwards; an explicit
RAY_AUTH_MODE is left alone. Each case runs in a fresh interpreter with its own HOME."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, ray
from raygym.cluster.ray_auth import private_cluster_auth
with private_cluster_auth() as used:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024 * 1024)
    @ray.remote
    def mode():
        return os.environ.get("RAY_AUTH_MODE"), bool(os.environ.get("RAY_AUTH_TOKEN"))
    print("USED", used, "TASK", ray.get(mode.remote()))
    ray.shutdown()
print("AFTER", os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN"))
"""


def run(home: Path, **env_extra: str) -> subprocess.CompletedProcess:
    ray_tmp = tempfile.mkdtemp(prefix="rga-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update({"HOME": str(home), "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO_ROOT), **env_extra})
    try:
        return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=150)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_private_token_no_file_no_warning(tmp_path):
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USED True TASK ('token', True)" in done.stdout  # auth stays on, workers hold the token
    assert "AFTER None None" in done.stdout
    assert not (tmp_path / ".ray" / "auth_token").exists()
    assert "Token authentication is enabled" not in done.stderr


def test_explicit_auth_mode_is_left_alone(tmp_path):
    done = run(tmp_path, RAY_AUTH_MODE="disabled")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USED False TASK ('disabled', False)" in done.stdout and "AFTER disabled None" in done.stdout
