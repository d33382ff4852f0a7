"""The first 3 steps of the tiny run (``raygym train --preset tiny``) reproduce the metrics stored in
``golden/tiny_first_steps.json``, so that any numeric drift (sampling, rewards, advantages, loss,
gradients, optimizer settings) shows up as a diff of that file.

The tiny preset is seeded, and on CPU two runs log bit-identical values for every metric that is not a
clock reading (checked by running it twice and comparing every key). Left out: wall-clock timings and
rates (``perf/*`` times, ``*_time``, ``*tokens_per_s``, ``sync/*`` seconds and bandwidth), the weight-sync
byte counts (a codec property, covered by the weight-sync tests) and the rollout/trainer log-prob
mismatch (float noise around 1e-7 by design).

Regenerate after an intended change, then review the diff of the JSON file:

    RAYGYM_UPDATE_GOLDEN=1 pytest tests/e2e/test_golden_metrics.py
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from raygym.run.config_loading import load_train_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_first_steps.json"
STEPS = 3
COMMAND = ["--preset", "tiny", "--num-rollout", str(STEPS)]

# Decided by the sampled tokens and the rewards alone: must match exactly.
EXACT_KEYS = (
    "rollout/samples",
    "rollout/generated_tokens",
    "rollout/response_len_mean",
    "rollout/response_len_max",
    "rollout/truncated_frac",
    "rollout/reward_mean",
    "rollout/reward/next_digit",
    "rollout/weight_version_min",
    "perf/train_tokens",
    "train/optimizer_steps",
)
# Float results of the reward statistics and the trainer: bit-identical run to run on one machine;
# the tolerance only absorbs another CPU's summation order.
CLOSE_KEYS = (
    "rollout/reward_std",
    "train/adv_mean",
    "train/adv_std",
    "train/adv_min",
    "train/adv_max",
    "train/entropy",
    "train/grad_norm",
    "train/loss",
    "train/pg_loss",
    "train/approx_kl",
    "train/clipfrac",
    "train/lr",
)
REL, ABS = 1e-4, 1e-7  # ABS only for values that are zero up to rounding (the GRPO loss is ~1e-9)


def golden_view(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The stored form: the command, the tolerance and the compared metrics of each step."""
    return {
        "command": "raygym train " + " ".join(COMMAND),
        "tolerance": {"exact": list(EXACT_KEYS), "rel": REL, "abs": ABS},
        "steps": [{key: row[key] for key in ("step", *EXACT_KEYS, *CLOSE_KEYS)} for row in rows],
    }


def differences(expected: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    if len(expected["steps"]) != len(observed["steps"]):
        return [f"{len(observed['steps'])} steps logged, {len(expected['steps'])} expected"]
    found = []
    for want, got in zip(expected["steps"], observed["steps"], strict=True):
        for key in ("step", *EXACT_KEYS, *CLOSE_KEYS):
            if key not in want or key not in got:
                found.append(f"step {want.get('step')}: {key} missing")
            elif key in CLOSE_KEYS:
                if not math.isclose(got[key], want[key], rel_tol=REL, abs_tol=ABS):
                    found.append(f"step {want['step']}: {key} = {got[key]!r}, golden {want[key]!r}")
            elif got[key] != want[key]:
                found.append(f"step {want['step']}: {key} = {got[key]!r}, golden {want[key]!r}")
    return found


def as_text(view: dict[str, Any]) -> str:
    return json.dumps(view, indent=1, sort_keys=True) + "\n"


def test_first_steps_of_the_tiny_run_match_the_golden_file(ray_local, tmp_path):
    from raygym.run.driver import train

    cfg = load_train_config([*COMMAND, "--output-dir", str(tmp_path / "run")])
    result = train(cfg)
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    observed = golden_view(rows)

    if os.environ.get("RAYGYM_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(as_text(observed))
        pytest.skip(f"rewrote {GOLDEN}")

    expected = json.loads(GOLDEN.read_text())
    found = differences(expected, observed)
    diff = "".join(difflib.unified_diff(as_text(expected).splitlines(keepends=True),
                                        as_text(observed).splitlines(keepends=True),
                                        fromfile=f"golden/{GOLDEN.name}", tofile="this run"))
    assert not found, "\n".join([*found, "", diff, "(RAYGYM_UPDATE_GOLDEN=1 rewrites the file)"])


def test_the_comparison_catches_a_drift_in_any_compared_key():
    row = {"step": 0, **{k: 1.0 for k in EXACT_KEYS}, **{k: 0.5 for k in CLOSE_KEYS}}
    golden = golden_view([row])
    assert differences(golden, golden_view([dict(row)])) == []
    for key in (*EXACT_KEYS, *CLOSE_KEYS):
        drifted = golden_view([{**row, key: row[key] * (1 + 3 * REL)}])
        assert differences(golden, drifted) == [f"step 0: {key} = {drifted['steps'][0][key]!r}, golden {row[key]!r}"]
