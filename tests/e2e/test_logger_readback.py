"""W&B and TensorBoard logging, read back with their own readers.

One real ``raygym train --preset tiny`` run logs to W&B (offline: no network, no account) and TensorBoard at
once. Its W&B transaction log is read by wandb's own reader (``wandb leet inspect --json``, which prints every
record of a run's ``.wandb`` file) and its event files by TensorBoard's ``EventAccumulator``; both must hold
exactly the scalars of raygym's ``metrics.jsonl``, step for step, and W&B the run's whole config. The HTML
report still renders for that run, and no credential in the driver's environment reaches any file it wrote.

A last test logs NaN and inf, which ``metrics.jsonl`` spells ``null`` and ``"inf"``: both trackers must get
them as numbers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("wandb", reason="needs wandb (the dev extra)")
pytest.importorskip("tensorboard", reason="needs tensorboard (the dev extra)")

import numpy as np  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

from raygym.config import MetricsConfig  # noqa: E402
from raygym.run.metrics import MetricsLogger  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
RUN_ID = "readback-run"
PROJECT = "raygym-readback"
# Fake credentials in the driver's environment: neither may appear in anything the run writes.
SECRETS = {"WANDB_API_KEY": "rgsecret" + "5" * 32, "HF_TOKEN": "hf_rgsecret" + "7" * 24}
WANDB_OWN_KEYS = {"_runtime", "_step", "_timestamp"}


@dataclass
class Run:
    out: Path  # the run directory (metrics.jsonl, config.json)
    wandb_dir: Path  # WANDB_DIR
    tb_dir: Path
    printed: str
    rows: list[dict[str, Any]]


def offline_env(wandb_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**env, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("readback")
    out, wandb_dir, tb_dir = root / "run", root / "wandb", root / "tb"
    wandb_dir.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="rgl-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**offline_env(wandb_dir), **SECRETS, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "raygym", "train", "--preset", "tiny", "--num-rollout", str(STEPS),
             "--run-id", RUN_ID, "--output-dir", str(out),
             "--wandb-project", PROJECT, "--wandb-mode", "offline", "--tensorboard-dir", str(tb_dir)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return Run(out, wandb_dir, tb_dir, printed, rows)


def expected_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers a metrics.jsonl row stands for: NaN is written ``null``, infinities ``"inf"``/``"-inf"``;
    anything else that is no number (text, lists, booleans) is no scalar metric."""
    scalars = {}
    for key, value in row.items():
        if value is None:
            scalars[key] = math.nan
        elif isinstance(value, str) and value in ("inf", "-inf"):
            scalars[key] = float(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[key] = float(value)
    return scalars


def wandb_records(run_path: Path, wandb_dir: Path) -> list[dict[str, Any]]:
    """Every record of the offline run's ``.wandb`` transaction log, as wandb's reader prints them."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run_path), "--json"],
                          env=offline_env(wandb_dir), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def only_wandb_run(wandb_dir: Path) -> Path:
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def wandb_history(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> the metrics W&B holds for it (its own ``_runtime``/``_timestamp`` left out; NaN and the
    infinities come as the strings "NaN", "Infinity", "-Infinity")."""
    history: dict[int, dict[str, float]] = {}
    for record in records:
        if record["type"] == "history":
            step = int(record["history"]["step"]["num"])
            assert step not in history, f"W&B holds step {step} twice"
            item = record["history"]["item"]
            assert item["_step"] == step
            history[step] = {k: float(v) for k, v in item.items() if k not in WANDB_OWN_KEYS}
    return history


def assert_same_numbers(got: dict[str, float], want: dict[str, float], where: str, rel: float) -> None:
    assert sorted(got) == sorted(want), f"{where}: keys differ: missing {sorted(set(want) - set(got))}, " \
                                        f"extra {sorted(set(got) - set(want))}"
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, nan_ok=True), f"{where} {key}: {got[key]} != {value}"


def tensorboard_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, every event kept (size guidance 0)."""
    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        scalars[tag] = {e.step: e.value for e in events}
        assert len(scalars[tag]) == len(events), f"TensorBoard {tag}: a step written twice"
    return scalars


def assert_tensorboard_matches(scalars: dict[str, dict[int, float]], rows: list[dict[str, Any]]) -> None:
    want: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in expected_scalars(row).items():
            if key != "step":
                want.setdefault(key, {})[row["step"]] = value
    assert sorted(scalars) == sorted(want), f"TensorBoard tags: missing {sorted(set(want) - set(scalars))}, " \
                                            f"extra {sorted(set(scalars) - set(want))}"
    for tag, by_step in want.items():
        assert sorted(scalars[tag]) == sorted(by_step), f"TensorBoard {tag}: steps {sorted(scalars[tag])}"
        for step, value in by_step.items():
            # TensorBoard stores float32: the value must be exactly the float32 nearest the logged one
            assert scalars[tag][step] == pytest.approx(float(np.float32(value)), rel=0, abs=0, nan_ok=True), \
                f"TensorBoard {tag} step {step}: {scalars[tag][step]} != {value}"


def test_wandb_history_and_config_match_the_run(run):
    records = wandb_records(only_wandb_run(run.wandb_dir), run.wandb_dir)
    history = wandb_history(records)
    assert sorted(history) == [r["step"] for r in run.rows]
    for row in run.rows:
        # metrics.jsonl's "step" goes to W&B as a metric too, equal to W&B's own step
        assert_same_numbers(history[row["step"]], expected_scalars(row), f"W&B step {row['step']}", rel=1e-12)

    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run_record["project"], run_record["run_id"], run_record["display_name"]) == (PROJECT, RUN_ID, RUN_ID)
    config = dict(run_record["config"]["update"])
    for record in records:  # config changes after init, if any
        if record["type"] == "config":
            config.update(record["config"]["update"])
    config.pop("_wandb", None)
    assert config == json.loads((run.out / "config.json").read_text())  # the whole config, as the run saved it
    assert config["run_id"] == RUN_ID
    assert config["recipe"]["num_rollout"] == STEPS
    assert config["recipe"]["advantage_estimator"] == "grpo"
    assert config["dataset"]["prompt_data"] == "builtin:next-digit"
    assert config["metrics"]["wandb_project"] == PROJECT
    assert config["metrics"]["tensorboard_dir"] == str(run.tb_dir)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


def test_tensorboard_scalars_match_the_run(run):
    assert_tensorboard_matches(tensorboard_scalars(run.tb_dir), run.rows)


def test_report_renders_the_run(run):
    done = subprocess.run([sys.executable, "-m", "raygym", "report", str(run.out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    page = (run.out / "report.html").read_text()
    assert RUN_ID in page
    assert "rollout/reward_mean" in page
    assert json.dumps(run.rows[-1]["rollout/reward_mean"]) in page  # the curve's last point


def test_no_credential_reaches_any_file_or_the_console(run):
    assert run.printed.strip()
    for directory in (run.out, run.wandb_dir, run.tb_dir):
        files = [p for p in directory.rglob("*") if p.is_file()]
        assert files, directory
        for path in files:
            data = path.read_bytes()
            for name, secret in SECRETS.items():
                assert secret.encode() not in data, f"{name} written to {path}"
    for name, secret in SECRETS.items():
        assert secret not in run.printed, f"{name} printed"


def test_nan_and_inf_reach_wandb_and_tensorboard_as_numbers(tmp_path, monkeypatch):
    import wandb

    wandb_dir, tb_dir = tmp_path / "wandb", tmp_path / "tb"
    wandb_dir.mkdir()
    for key, value in offline_env(wandb_dir).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    steps = [{"train/loss": 0.5, "train/grad_norm": np.float32(1.25), "x": 3},
             {"train/loss": float("nan"), "train/grad_norm": float("inf"), "x": -float("inf")},
             {"train/loss": 0.25, "train/grad_norm": 2.0, "x": 4, "note": "text", "flag": True}]
    mc = MetricsConfig(wandb_project=PROJECT, wandb_mode="offline", tensorboard_dir=str(tb_dir))
    try:
        with MetricsLogger(tmp_path / "run", mc, run_id="nonfinite", config_dict={"recipe": {"lr": 0.1}}) as log:
            for step, metrics in enumerate(steps):
                log.log(step, metrics)
    finally:
        wandb.teardown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1] == {"step": 1, "train/loss": None, "train/grad_norm": "inf", "x": "-inf"}

    history = wandb_history(wandb_records(only_wandb_run(wandb_dir), wandb_dir))
    assert sorted(history) == [0, 1, 2]
    for row in rows:
        assert_same_numbers(history[row["step"]], expected_scalars(row), f"W&B step {row['step']}", rel=1e-12)
    assert math.isnan(history[1]["train/loss"]) and history[1]["x"] == -math.inf
    assert_tensorboard_matches(tensorboard_scalars(tb_dir), rows)
