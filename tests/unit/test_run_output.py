"""What a user reads: the banner, step lines piped (plain, under 80 columns) and on a terminal (a bar
with elapsed and ETA), the closing line, the help text, plan's notes, export's message and file
modes, and a one-line TrainResult."""

from __future__ import annotations

import io
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from raygym import ModelConfig, TrainConfig
from raygym.cli.main import main
from raygym.presets import tiny
from raygym.run.display import StepProgress, banner_lines
from raygym.run.driver import TrainResult
from raygym.run.metrics import progress_line, summary_table
from raygym.run.preflight import preflight

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[")


def row(step: int, **extra) -> dict:
    return {"step": step, "rollout/reward_mean": 0.123, "rollout/response_len_mean": 7.5, "perf/step_time": 1.5,
            "perf/tokens_per_s": 812.0, **extra}


def test_piped_step_lines_are_plain_and_fit_80_columns():
    out = io.StringIO()
    console = Console(file=out)  # not a terminal: what `raygym train | tee log` gets
    assert not console.is_terminal
    with StepProgress(console, first_step=5, num_steps=1000) as progress:
        for step in (5, 6, 999):
            progress.step(row(step, **{"rollout/response_len_mean": 4096.0, "perf/step_time": 123.25,
                                       "perf/tokens_per_s": 123456.0, "rollout/reward_mean": -0.125}))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5", "6", "999"]  # the step ids of metrics.jsonl
    assert lines[0].startswith("step 5 [6/1000]") and lines[-1].startswith("step 999 [1000/1000]")
    assert all(len(line) < 80 for line in lines), [len(line) for line in lines]
    assert all("eta " in line for line in lines) and not ANSI.search(out.getvalue())
    assert "eta 0:00" in lines[-1]


def test_line_tightens_by_dropping_throughput_first():
    assert progress_line(row(4), 10, eta=18.0) == "step 4 [5/10]  reward 0.123  len 7.5  1.50s/step  812 tok/s  eta 0:18"
    assert progress_line(row(4), 10, elapsed=12.0, eta=18.0) == (
        "step 4 [5/10]  reward 0.123  len 7.5  1.50s/step  elapsed 0:12  eta 0:18")


def test_terminal_gets_a_progress_bar_with_elapsed_and_eta():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with StepProgress(console, first_step=0, num_steps=4) as progress:
        progress.step(row(0))
        progress.step(row(1))
    text = out.getvalue()
    assert "step 0 [1/4]" in text and "step 1 [2/4]" in text
    assert "2/4" in ANSI.sub("", text).replace("\x1b", "") and "elapsed" in text and "eta" in text
    assert progress.final_line(0, 1, "runs/x", 75.0).startswith("done: steps 0-1 (2 steps) in 1:15 (")


def test_banner_says_model_data_rows_reward_engines_and_logical_gpus(tmp_path):
    cfg = TrainConfig(recipe=tiny(), model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"),
                      output_dir=str(tmp_path / "run"))
    lines = banner_lines(cfg, preflight(cfg), trainer_backend="torch", engine_kind="raygym", logical_gpus=True)
    text = "\n".join(lines)
    for needle in ("model      builtin:tiny-qwen3", "builtin:next-digit: 1024 rows", "reward     next_digit",
                   "steps      0-99 of num_rollout=100", "trainer    torch on 1 GPU",
                   "engines    1 raygym engine x 1 GPU", "2 logical", str(tmp_path / "run")):
        assert needle in text, needle


def test_summary_has_critic_rows_and_reward_components():
    history = [row(i, **{"critic/value_loss": 1.0 / (i + 1), "train/loss": 1e-9, "rollout/reward/a": 0.1,
                         "rollout/reward/b": 0.2}) for i in range(3)]
    table = summary_table(history)
    names = list(table.columns[0].cells)
    assert "critic/value_loss" in names and "rollout/reward/a" in names and "train/loss" in names
    assert names.index("rollout/reward/a") < names.index("train/loss")


def test_train_result_repr_is_one_line():
    steps = [{"step": i, "rollout/reward_mean": 0.5, "big": list(range(100))} for i in range(50)]
    result = TrainResult(run_dir="runs/x", metrics_path="runs/x/metrics.jsonl", final_step=49,
                         checkpoint_paths=["runs/x/checkpoints/iter_0000049"], steps=steps, events=["0:train"] * 100)
    text = repr(result)
    assert "\n" not in text and len(text) < 300 and "steps 0-49 this run" in text and "iter_0000049" in text
    assert result.steps is steps  # the rows are still there, only not printed


def test_help_lists_defaults_choices_presets_and_toml_syntax(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "@ run.toml" in text and "[recipe] [model] [dataset] [metrics]" in text
    assert "qwen3-0.6b, qwen3-1.7b, qwen3-4b" in text and "qwen3-0-6b" not in text
    flat = " ".join(text.split())
    assert "--num-rollout INT Training and rollout steps for the run. (default: 1; tiny: 100)" in flat
    assert "'math_verify'" in flat and "'next_digit'" in flat  # rm types
    assert "'reinforce_plus_plus'" in flat and "'dr_grpo'" in flat  # estimators
    assert "--no-colocate to turn off" in flat


def test_plan_prints_notes_not_python_warnings():
    done = subprocess.run([sys.executable, "-m", "raygym", "plan", "--preset", "qwen3-4b", "--no-colocate"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "raygym: note: " in done.stderr and "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr
    tiny_plan = subprocess.run([sys.executable, "-m", "raygym", "plan"], capture_output=True, text=True, timeout=120,
                               cwd=REPO_ROOT)
    assert "2 nodes x 1 GPU," in tiny_plan.stdout
    if not Path("/proc/driver/nvidia/gpus").is_dir():
        assert "logical" in tiny_plan.stderr


@pytest.mark.slow  # a CLI subprocess importing torch
def test_export_names_the_step_and_keeps_file_modes(tmp_path):
    from raygym.builtin import build_tiny_model, materialize_model
    from raygym.checkpoint.store import save_checkpoint

    source = materialize_model("builtin:tiny-qwen3", tmp_path / "models")
    model, _ = build_tiny_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (3, 7):
        save_checkpoint(str(tmp_path / "ckpt"), step, model_state=state, hf_source=source)
    done = subprocess.run([sys.executable, "-m", "raygym", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "iter_0000007 (saved after step 7)" in done.stdout and f"exported step 7 to {tmp_path / 'hf'}" in done.stdout
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and len(set(modes.values())) == 1, modes
    expected = 0o666 & ~_umask()
    assert modes["model.safetensors"] == expected


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("args", [["export", "/nonexistent/ckpt", "/tmp/x"]])
def test_export_without_a_checkpoint_is_a_config_error(args, capsys):
    assert main(args) == 2
    assert "no complete raygym checkpoint found there" in capsys.readouterr().err
