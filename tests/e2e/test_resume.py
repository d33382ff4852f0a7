"""Resume: a run stopped after a checkpoint and restarted with the same save/load continues at the next
step, at the same data position, and (CPU, fixed seed) logs the same metrics as an uninterrupted run.

Run A goes 4 steps uninterrupted, checkpointing after steps 1 and 3. Run B starts from a copy of A's
step-1 checkpoint only (what a run killed right after that checkpoint leaves behind) with the same
recipe, so it must continue at step 2 and reproduce A's steps 2 and 3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL
from raygym.presets import tiny

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Sampled tokens decide these: they must match exactly.
EXACT_KEYS = ("rollout/reward_mean", "rollout/response_len_mean", "rollout/generated_tokens",
              "rollout/truncated_frac", "rollout/weight_version_min")
# Float results of the trainer on identical inputs and state.
CLOSE_KEYS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/adv_mean")


def tiny_config(out: Path, **overrides: Any) -> TrainConfig:
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 4,
              "global_batch_size": 16, "num_rollout": 4, "save_interval": 2, "seed": 7, **overrides}
    return TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=TINY_MODEL),
                       dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK), output_dir=str(out))


def rows_of(result: Any) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_resume_continues_with_same_metrics(ray_local, tmp_path):
    from raygym.checkpoint.store import latest_checkpoint, load_checkpoint
    from raygym.run.driver import train

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    full = train(tiny_config(a_dir, rollout_num_gpus=2))
    assert full.final_step == 3
    a = rows_of(full)
    assert sorted(a) == [0, 1, 2, 3]
    assert [Path(p).name for p in full.checkpoint_paths] == ["iter_0000001", "iter_0000003"]

    # What a run killed after its step-1 checkpoint leaves: that checkpoint and steps 0-1 of metrics.
    save = b_dir / "checkpoints"
    shutil.copytree(full.checkpoint_paths[0], save / "iter_0000001")
    b_dir.mkdir(exist_ok=True)
    (b_dir / "metrics.jsonl").write_text("".join(json.dumps(a[s]) + "\n" for s in (0, 1)))
    extra = load_checkpoint(str(save / "iter_0000001"), load_optimizer=False).extra
    assert extra["data_state"]["train"]["offset"] == 8  # 2 steps x 4 prompts consumed

    resumed = train(tiny_config(b_dir, rollout_num_gpus=2, save=str(save), load=str(save)))
    assert resumed.final_step == 3
    assert [r["step"] for r in resumed.steps] == [2, 3]  # continued at the next step, not at 0
    b = rows_of(resumed)
    assert sorted(b) == [0, 1, 2, 3]  # the metrics file is continued
    assert latest_checkpoint(str(save)).rollout_id == 3
    for step in (2, 3):
        for key in EXACT_KEYS:
            assert b[step][key] == a[step][key], (step, key, b[step][key], a[step][key])
        for key in CLOSE_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    # the two checkpoints of step 3 hold the same weights
    wa = load_checkpoint(full.checkpoint_paths[-1], load_optimizer=False).model_state
    wb = load_checkpoint(resumed.checkpoint_paths[-1], load_optimizer=False).model_state
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() <= 1e-5, name
