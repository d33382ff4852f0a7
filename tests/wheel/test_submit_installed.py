"""``raygym submit`` from an installed raygym: its wheel in a fresh venv, run from a user's directory outside the
checkout, against a real local Ray head with its dashboard, started by the same install (the venv activated: its
``bin`` first on PATH, so the job's ``python -m raygym.train`` is the installed raygym too).

The job's working_dir is the user's directory: the run reads its TOML file there, on the cluster. The head runs in
its own RAY_TMPDIR and process group, on free ports, and is ended by that group's id only
(tests/e2e/ray_head_process.py)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.ray_head_process import free_ports, ray_head_process

pytestmark = pytest.mark.timeout(900)


def _dashboard_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:  # it answers, so it is up
        return True
    except OSError:
        return False


def test_raygym_submit_from_an_install_runs_the_users_directory_on_the_cluster(
    wheel_python: str, user_env: dict[str, str], tmp_path: Path
) -> None:
    bin_dir = Path(wheel_python).parent
    env = {**user_env, "PATH": f"{bin_dir}:{user_env.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent)}
    user_dir = tmp_path / "my-project"  # outside the checkout: nothing imports from the source tree
    user_dir.mkdir()
    (user_dir / "run.toml").write_text('preset = "tiny"\nnum_rollout = 3\n')
    out_dir = tmp_path / "run"

    gcs, dash, agent_http, agent_grpc, rt_agent, metrics, nm, om, client = free_ports(9)
    ports = ["--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
             "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
             "--runtime-env-agent-port", str(rt_agent), "--metrics-export-port", str(metrics),
             "--node-manager-port", str(nm), "--object-manager-port", str(om), "--ray-client-server-port", str(client)]
    url = f"http://127.0.0.1:{dash}"
    with ray_head_process(ports, env, ready=lambda: _dashboard_up(url), timeout_s=120, python=wheel_python,
                          cwd=str(user_dir)):
        done = subprocess.run(
            [str(bin_dir / "raygym"), "submit", "--address", url, "--", "@", "run.toml", "--output-dir", str(out_dir)],
            cwd=user_dir, env=env, capture_output=True, text=True, timeout=780,
        )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    # the equivalent `ray job submit` line: the user's directory is the job's working_dir
    assert f'"working_dir": "{user_dir.resolve()}"' in done.stdout, said[-6000:]
    # the job's own output, followed until it ended: `raygym train`'s summary, then the final status
    summary = rf"metrics: +{re.escape(str(out_dir / 'metrics.jsonl'))} \(steps \d+-\d+ this run; 3 rows\)"
    assert re.search(summary, done.stdout), said[-6000:]
    assert re.search(r"job \S+ ended: SUCCEEDED", done.stdout), said[-6000:]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 3 and len({row["step"] for row in rows}) == 3
