"""``--auto-split`` end to end, as a user runs it: the first steps measure rollout and training, the run saves a
checkpoint, re-picks the split of cores, says what it chose and why, and goes on from that checkpoint with every
step logged once and every prompt trained on exactly once; ``raygym plan --split-from`` reads the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS, PROBE, BATCH = 6, 3, 4


def test_auto_split_repicks_at_a_checkpoint_and_goes_on(tmp_path: Path):
    out = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tempfile.mkdtemp(prefix="rgas-", dir="/tmp"),
           "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    run = subprocess.run(
        [sys.executable, "-m", "raygym", "train", "--fully-async", "--auto-split", "--auto-split-probe-steps",
         str(PROBE), "--num-rollout", str(STEPS), "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "4",
         "--global-batch-size", "16", "--save", str(out / "checkpoints"), "--output-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    said = run.stdout
    assert f"split: auto; steps up to {PROBE - 1} measure rollout and training" in said, said[-3000:]
    assert f"resumed from {out / 'checkpoints'}" in said and f"continuing at step {PROBE}" in said, said[-3000:]

    split = json.loads((out / "split.json").read_text())
    cores = len(os.sched_getaffinity(0))
    assert split["unit"] == "cores" and split["step"] == PROBE - 1
    assert split["engine_devices"] + split["trainer_devices"] == cores
    assert split["measured"]["rollout_s"] > 0 and split["measured"]["train_s"] > 0
    assert f"auto_split: {split['reason']}" in said and f"split: {split['reason']}" in said  # and leg 2's header
    if cores == 2:  # one engine core and one trainer core is the only disjoint split here
        assert not split["changed"] and "the only split allowed" in split["reason"]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    keys = [k for line in (out / "prompts.jsonl").read_text().splitlines() for k in json.loads(line)["prompt_key"]]
    assert len(keys) == STEPS * BATCH == len(set(keys))  # exactly once across the re-pick
    chosen = json.loads((out / "config.json").read_text())["recipe"]
    assert chosen["cpu_engine_cores"] == split["engine_devices"]  # the rest of the run ran the choice

    plan = subprocess.run([sys.executable, "-m", "raygym", "plan", "--split-from", str(out), "--cores", "16"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "flags: --cpu-engine-cores" in plan.stdout and "measured rollout" in plan.stdout
