"""A run against an already-running local Ray cluster, through its address (``RAY_ADDRESS``).

The cluster is started by this module (``ray start --head --block`` in its own process group, on free
ports, in its own RAY_TMPDIR) and ended by that process group's id; nothing else is touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ray_head_process import free_ports, head_env, ray_head_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head (no dashboard, auth off, 2 logical GPUs); yields (address, env for clients)."""
    gcs, nm, om, metrics, rt_agent, agent_grpc, agent_http = free_ports(7)
    _, env = head_env(RAY_AUTH_MODE="disabled")
    address = f"127.0.0.1:{gcs}"
    ports = ["--port", str(gcs), "--include-dashboard", "false", "--node-manager-port", str(nm),
             "--object-manager-port", str(om), "--metrics-export-port", str(metrics),
             "--runtime-env-agent-port", str(rt_agent), "--dashboard-agent-grpc-port", str(agent_grpc),
             "--dashboard-agent-listen-port", str(agent_http)]

    def two_gpus_visible() -> bool:
        probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={address!r}); "
                                "print(int(ray.cluster_resources().get('GPU', 0)))"],
                               env=env, capture_output=True, text=True, timeout=60)
        return probe.returncode == 0 and probe.stdout.strip().endswith("2")

    with ray_head_process(ports, env, ready=two_gpus_visible):
        yield address, env


def test_train_attaches_to_the_cluster_at_ray_address(ray_head, tmp_path):
    address, env = ray_head
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "raygym.train", "--preset", "tiny", "--num-rollout", "2",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--output-dir", str(out)]
    run = subprocess.run(argv, env={**env, "RAY_ADDRESS": address}, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=240)
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-4000:]
    assert "Started a local Ray instance" not in printed  # it joined the cluster instead
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]

    # The cluster saw the run as a (finished) driver job, and got every resource back.
    script = (
        "import json, sys, ray\n"
        "from ray._private import state\n"
        "ray.init(address=sys.argv[1])\n"
        "me = ray.get_runtime_context().get_job_id()\n"
        "jobs = [j for j in state.jobs() if sys.argv[2] in str(j.get('Entrypoint', '')) and j['JobID'] != me]\n"
        "print(json.dumps({'jobs': len(jobs), 'dead': all(j['IsDead'] for j in jobs),\n"
        "                  'gpus_free': ray.available_resources().get('GPU', 0),\n"
        "                  'groups': [g['state'] for g in ray.util.placement_group_table().values()]}))\n"
    )
    check = subprocess.run([sys.executable, "-c", script, address, str(out)], env=env, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr[-2000:]
    seen = json.loads(check.stdout.strip().splitlines()[-1])
    assert seen["jobs"] == 1 and seen["dead"], seen
    assert seen["gpus_free"] == 2 and all(s == "REMOVED" for s in seen["groups"]), seen
