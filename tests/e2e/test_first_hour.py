"""A new user's first runs, through the real `raygym train` command:

- a TRL-style reward function in the working directory, given by import path, scores every sample of
  every step (checked against the traced responses), and the run reads the same everywhere: banner,
  step lines numbered from 0 like metrics.jsonl and `iter_*`, the closing line;
- a remote data file (real HTTP) whose bad row lies beyond the rows checked before start-up fails in
  the rollout manager, and the user still gets that ConfigError's own message and exit code 2.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from raygym.builtin import next_digit_rows

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

TRL_REWARDS = '''
def digit_trl(prompts, completions, label, **kwargs):
    """TRL style: lists in, a list out; the data column `label` by name; None = no reward."""
    out = []
    for completion, truth in zip(completions, label):
        text = completion.strip()
        if not text:
            out.append(None)
        elif text[0] == truth:
            out.append(1.0)
        else:
            out.append(0.5 if text[0].isdigit() else 0.0)
    return out
'''


def expected_reward(response: str, label: str) -> float:
    text = response.strip()
    if not text:
        return 0.0  # no reward from the only function
    return 1.0 if text[0] == label else (0.5 if text[0].isdigit() else 0.0)


def run_train(cwd: Path, *args: str, timeout: int = 280) -> subprocess.CompletedProcess:
    ray_tmp = tempfile.mkdtemp(prefix="rgf-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("COLUMNS", None)
    try:
        return subprocess.run([sys.executable, "-m", "raygym", "train", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_trl_reward_by_import_path_scores_every_step(tmp_path):
    (tmp_path / "my_rewards.py").write_text(TRL_REWARDS)
    out = tmp_path / "run"
    run = run_train(tmp_path, "--custom-rm-function", "my_rewards:digit_trl", "--num-rollout", str(STEPS),
                    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
                    "--capture-trace", "--output-dir", str(out))
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-4000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    labels = {i: r["label"] for i, r in enumerate(next_digit_rows(1024, 0))}  # the builtin data, seed 0
    for r in rows:
        assert r["rollout/reward_errors"] == 0.0, r
        assert r["rollout/reward/digit_trl"] >= 0.0
        traces = [json.loads(line) for line in (out / "traces" / f"step_{r['step']:06d}.jsonl").read_text().splitlines()]
        assert traces, r["step"]
        for t in traces:  # the reward of each traced sample is this function's verdict on its response
            assert t["reward"] == expected_reward(t["response_text"], labels[t["data_index"]]), t
    assert any(r["rollout/reward_mean"] > 0 for r in rows)

    # One numbering: console, metrics.jsonl, iter_*, the closing lines.
    assert "reward     digit_trl (TRL fn(prompts, completions, ...), my_rewards:digit_trl)" in printed
    assert "data       builtin:next-digit: 1024 rows" in printed
    assert [int(m) for m in re.findall(r"^step (\d+) \[\d+/3\]", run.stdout, flags=re.M)] == list(range(STEPS))
    for step in range(STEPS):
        assert f"step {step} [{step + 1}/{STEPS}]" in run.stdout
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("iter_")] == ["iter_0000002"]
    assert f"done: steps 0-{STEPS - 1} ({STEPS} steps) in " in run.stdout
    assert "(steps 0-2 this run; 3 rows)" in run.stdout and "(after step 2)" in run.stdout
    assert "\x1b[" not in run.stdout  # piped: no colour codes
    assert all(len(line) < 80 for line in run.stdout.splitlines() if line.startswith("step "))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_remote_data_error_found_by_the_rollout_manager_exits_2_with_its_message(tmp_path):
    rows = [json.dumps(r) for r in next_digit_rows(1100, 1)] + ['{"prompt": "next:1=", "label": }']
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "digits.jsonl").write_text("\n".join(rows) + "\n")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path / "served")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/digits.jsonl"
    try:
        run = run_train(tmp_path, "--prompt-data", url, "--reward-functions", '{"next_digit": 1.0}',
                        "--num-rollout", "2", "--output-dir", str(tmp_path / "run"))
    finally:
        server.shutdown()
        server.server_close()
    assert run.returncode == 2, (run.stdout + run.stderr)[-4000:]
    assert "first 1000 rows checked (remote)" in run.stdout  # the banner says what was checked
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("raygym: error: prompt data ") and url in last and "line 1101" in last, last
    assert "\x1b[" not in run.stderr and "actor died" not in run.stderr
