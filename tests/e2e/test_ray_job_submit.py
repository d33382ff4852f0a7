"""`launchers.ray_job` against a real local Ray head with its dashboard.

The head is started by this module (`ray start --head --block` in its own process group, on free
ports, in its own RAY_TMPDIR) and ended by that process group's id — nothing else is touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from launchers.ray_job import REPO_ROOT, main, submit_train_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKEN = "raygym-e2e-token-0123456789abcdef"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _dashboard_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:  # 401 without a token: the dashboard answers, so it is up
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head with dashboard and token auth on; yields (dashboard URL, env for clients)."""
    gcs, dash, agent_http, agent_grpc, rt_agent, metrics, nm, om, client = _free_ports(9)
    tmp = tempfile.mkdtemp(prefix="rgj-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    env.pop("RAY_ADDRESS", None)
    cmd = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dash), "--dashboard-agent-listen-port", str(agent_http),
        "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(rt_agent),
        "--metrics-export-port", str(metrics), "--node-manager-port", str(nm),
        "--object-manager-port", str(om), "--ray-client-server-port", str(client),
        "--num-cpus", "4", "--num-gpus", "2", "--object-store-memory", str(256 * 1024 * 1024),
        "--disable-usage-stats",
    ]  # fmt: skip
    log = open(Path(tmp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 60
        while not _dashboard_up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray head did not come up:\n{(Path(tmp) / 'ray-start.log').read_text()}")
            time.sleep(0.5)
        yield url, env
    finally:
        # Our own process group only: `ray start --block` ends the Ray processes it spawned on SIGTERM;
        # anything of that group still alive afterwards is killed by the group id.
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        log.close()


def test_tiny_job_succeeds_through_the_launcher(ray_head, tmp_path):
    url, env = ray_head
    out_dir = tmp_path / "run"
    lines: list[str] = []
    caller_env = {**env, "WANDB_API_KEY": "wandb-secret-value-xyz", "WANDB_MODE": "disabled"}
    outcome = submit_train_job(
        url,
        ["--preset", "tiny", "--num-rollout", "2", "--output-dir", str(out_dir)],
        environ=caller_env,
        working_dir=str(REPO_ROOT),
        out=lines.append,
    )
    printed = "\n".join(lines)
    assert outcome.status == "SUCCEEDED", printed[-4000:]
    assert f"job id: {outcome.job_id}" in printed
    assert "wandb-secret-value-xyz" not in printed and TOKEN not in printed
    metrics = out_dir / "metrics.jsonl"
    assert metrics.exists(), printed[-4000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
    assert len(steps) == 2


def test_cli_without_token_is_refused(ray_head, monkeypatch, tmp_path, capsys):
    url, env = ray_head
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # so no default token file is picked up either
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(Exception, match="(?i)auth|401|unauthori"):
        main(["--address", url, "--no-wait", "--preset", "tiny", "--num-rollout", "1"])
