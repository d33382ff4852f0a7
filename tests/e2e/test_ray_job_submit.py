"""`raygym.launchers.ray_job` against a real local Ray head with its dashboard.

The head is started by this module (`ray start --head --block` in its own process group, on free
ports, in its own RAY_TMPDIR) and ended by that process group's id — nothing else is touched.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from ray_head_process import free_ports, head_env, ray_head_process

from raygym.launchers.ray_job import REPO_ROOT, main, submit_eval_job, submit_train_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TOKEN = "raygym-e2e-token-0123456789abcdef"


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
    gcs, dash, agent_http, agent_grpc, rt_agent, metrics, nm, om, client = free_ports(9)
    _, env = head_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    ports = ["--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
             "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
             "--runtime-env-agent-port", str(rt_agent), "--metrics-export-port", str(metrics),
             "--node-manager-port", str(nm), "--object-manager-port", str(om), "--ray-client-server-port", str(client)]
    url = f"http://127.0.0.1:{dash}"
    with ray_head_process(ports, env, ready=lambda: _dashboard_up(url), timeout_s=60):
        yield url, env


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


def test_eval_job_runs_raygym_eval_on_the_cluster(ray_head, tmp_path):
    from raygym.builtin import next_digit_rows

    url, env = ray_head
    data = tmp_path / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in next_digit_rows(12, seed=3)))
    lines: list[str] = []
    outcome = submit_eval_job(
        url, "builtin:tiny-qwen3",
        ["--preset", "tiny", "--prompt-data", str(data), "--n-samples-per-eval-prompt", "2",
         "--out", str(tmp_path / "eval")],
        environ=env, working_dir=str(REPO_ROOT), out=lines.append,
    )  # fmt: skip
    printed = "\n".join(lines)
    assert outcome.status == "SUCCEEDED", printed[-4000:]
    assert "-m raygym eval builtin:tiny-qwen3" in printed and TOKEN not in printed
    summary = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert summary["datasets"] == {"digits": str(data)} and "eval/digits/pass@2" in summary["metrics"]
    assert len((tmp_path / "eval" / "samples.jsonl").read_text().splitlines()) == 12 * 2


def test_cli_without_token_is_refused(ray_head, monkeypatch, tmp_path, capsys):
    url, env = ray_head
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # so no default token file is picked up either
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(Exception, match="(?i)auth|401|unauthori"):
        main(["--address", url, "--no-wait", "--preset", "tiny", "--num-rollout", "1"])
