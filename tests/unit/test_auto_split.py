"""``auto_split``: the split chosen from measured rates (raygym.cluster.split_choice), the splits a recipe allows
and the recipe that runs the choice (raygym.run.auto_split), the rules on the fields, and ``raygym plan
--split-from``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raygym.cluster.split_choice import (
    MIN_GAIN,
    MeasuredSplit,
    choose_split,
    measured_from_rows,
    predicted_step_s,
)
from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.errors import ConfigError
from raygym.presets import tiny
from raygym.run.auto_split import (
    allowed_splits,
    apply_split,
    choose_for_run,
    current_split,
    gpu_split_recipes,
)

ROOT = Path(__file__).resolve().parents[2]
EIGHT_CORES = [(g, 8 - g) for g in range(1, 8)]


def test_rollout_heavy_gives_engines_more_devices_and_beats_even():
    measured = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=3.0, train_s=1.0, steps=5)
    choice = choose_split(measured, EIGHT_CORES, unit="cores")
    # rollout work 12, train work 4 device-seconds: 6/2 balances them (2 s a side against even's 3 s)
    assert (choice.engine_devices, choice.trainer_devices) == (6, 2)
    assert choice.predicted_step_s == pytest.approx(2.0) and choice.even_step_s == pytest.approx(3.0)
    assert choice.gain_over_even == pytest.approx(1.5) and choice.changed
    assert "chose engines 6 cores, trainer 2 cores" in choice.reason() and "1.50x an even split" in choice.reason()


def test_train_heavy_gives_trainer_more_devices():
    measured = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=0.5, train_s=3.5, steps=5)
    choice = choose_split(measured, EIGHT_CORES, unit="cores")
    assert (choice.engine_devices, choice.trainer_devices) == (1, 7)


def test_balanced_split_is_kept_and_small_gains_do_not_move_it():
    balanced = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=1.0, train_s=1.0, steps=5)
    assert not choose_split(balanced, EIGHT_CORES, unit="cores").changed
    # measured 4/4: rollout work 4.0, train 2.88 device-seconds; 5/3 predicts 0.96 s against 1.0 s, under MIN_GAIN
    slight = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=1.0, train_s=0.72, steps=5)
    assert 1.0 < predicted_step_s(slight, 4, 4) / predicted_step_s(slight, 5, 3) < MIN_GAIN
    kept = choose_split(slight, [(4, 4), (5, 3)], unit="cores")
    assert not kept.changed and "no other allowed split predicts" in kept.reason()
    clear = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=1.0, train_s=0.6, steps=5)  # 1.25x
    assert choose_split(clear, [(4, 4), (5, 3)], unit="cores").engine_devices == 5


def test_only_split_is_said_so():
    measured = MeasuredSplit(engine_devices=1, trainer_devices=1, rollout_s=2.0, train_s=0.5, steps=4)
    choice = choose_split(measured, [(1, 1)], unit="cores")
    assert not choice.changed and "the only split allowed" in choice.reason()


def test_measured_from_rows_leaves_out_warmup_and_adds_log_probs():
    rows = [{"rollout/generate_time": 10.0, "perf/train_time": 10.0},
            {"rollout/generate_time": 2.0, "perf/train_time": 1.0, "perf/log_probs_time": 0.5},
            {"rollout/generate_time": 4.0, "perf/train_time": 1.0, "perf/log_probs_time": 0.5},
            {"rollout/generate_time": 3.0, "perf/train_time": 2.0, "perf/log_probs_time": 0.5}]
    m = measured_from_rows(rows, engine_devices=2, trainer_devices=6)
    assert (m.rollout_s, m.train_s, m.steps) == (3.0, 1.5, 4)
    assert m.rollout_work == 6.0 and m.train_work == 9.0


def test_cpu_splits_follow_the_cores_and_ranks():
    recipe = tiny().replace(fully_async=True, num_rollout=8, auto_split=True)
    assert allowed_splits(recipe, cuda=False, node_cores=2) == ([(1, 1)], "cores")
    assert current_split(recipe.replace(cpu_engine_cores=3), cuda=False, node_cores=8) == (3, 5)
    rows = [{"rollout/generate_time": 3.0, "perf/train_time": 0.25}] * 4
    choice = choose_for_run(recipe, rows, cuda=False, node_cores=8)  # measured on 1 engine core, 7 trainer
    assert choice.engine_devices > 1
    assert apply_split(recipe, choice, cuda=False).cpu_engine_cores == choice.engine_devices


def test_gpu_splits_are_recipes_that_validate():
    recipe = Recipe(actor_num_gpus_per_node=4, colocate=False, rollout_num_gpus=4, async_mode=True,
                    rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=8, num_rollout=10)
    splits = gpu_split_recipes(recipe)
    assert (4, 4) in splits and all(g + t == 8 for g, t in splits)
    for (engines, trainer), candidate in splits.items():
        alloc = candidate.gpu_allocation()
        assert (alloc.rollout_gpus, alloc.actor_gpus) == (engines, trainer)
    rows = [{"rollout/generate_time": 4.0, "perf/train_time": 1.0}] * 5  # rollout work 16, train 4
    choice = choose_for_run(recipe, rows, cuda=True, node_cores=0)
    assert choice.unit == "GPUs" and choice.engine_devices > choice.trainer_devices
    chosen = apply_split(recipe, choice, cuda=True)
    assert chosen.gpu_allocation().rollout_gpus == choice.engine_devices


@pytest.mark.parametrize("fields, words", [
    ({"auto_split": True, "num_rollout": 10}, "--no-colocate with --async-mode or --fully-async"),
    ({"auto_split": True, "fully_async": True, "num_rollout": 3}, "--auto-split-probe-steps"),
    ({"auto_split": True, "fully_async": True, "num_rollout": 10, "auto_split_probe_steps": 2},
     "auto_split_probe_steps=2"),
    ({"cpu_engine_cores": 0}, "cpu_engine_cores=0"),
])
def test_bad_split_fields_are_config_errors(fields, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        tiny().replace(**fields)


def test_plan_says_the_split_is_chosen_by_measurement():
    out = subprocess.run([sys.executable, "-m", "raygym", "plan", "--fully-async", "--auto-split", "--num-rollout", "10"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "split: auto; steps up to 3 measure rollout and training" in out.stdout


def test_plan_split_from_a_run_dir(tmp_path: Path):
    recipe = tiny().replace(fully_async=True, num_rollout=8, auto_split=True)
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"), output_dir=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_json_dict(), default=str))
    rows = [{"step": i, "rollout/generate_time": 3.0, "perf/train_time": 0.5} for i in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "raygym", "plan", "--split-from", str(tmp_path), "--cores", "8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "chose engines" in out.stdout and "--cpu-engine-cores" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "raygym", "plan", "--split-from", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr
