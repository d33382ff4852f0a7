"""PPO end to end: the critic is a group of its own trainer actors, wired into the loop.

Run A trains 3 PPO steps (GAE over the critic's values) and checkpoints policy and critic after steps 1
and 2. Run B restarts from a copy of A's step-1 checkpoints (policy and ``critic/``) and must reproduce
A's step 2, the critic's numbers included — which only holds if the critic was saved and restored.
Run C is given a policy checkpoint whose critic is missing and must refuse to start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL
from raygym.errors import ConfigError
from raygym.presets import tiny

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CRITIC_KEYS = ("critic/value_loss", "critic/value_mean", "critic/returns_mean")


def ppo_config(out: Path, **overrides: Any) -> TrainConfig:
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 16,
              "num_rollout": 3, "save_interval": 2, "seed": 3, "advantage_estimator": "ppo", "use_critic": True,
              "gamma": 1.0, "lambd": 0.95, "critic_lr": 1e-2, **overrides}
    return TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=TINY_MODEL),
                       dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK), output_dir=str(out))


def rows_of(result: Any) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in map(json.loads, Path(result.metrics_path).read_text().splitlines())}


def test_ppo_trains_critic_checkpoints_resumes_and_refuses_mixed_steps(ray_local, tmp_path):
    from raygym.checkpoint.store import list_checkpoints
    from raygym.run.driver import train

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    full = train(ppo_config(a_dir))
    assert full.final_step == 2
    a = rows_of(full)
    for row in a.values():
        for key in (*CRITIC_KEYS, "train/loss", "train/adv_mean"):
            assert isinstance(row.get(key), float), (key, row.get(key))
    # The value head starts at zero, so the first step's values are 0; training moves them.
    assert a[0]["critic/value_mean"] == 0.0
    assert a[2]["critic/value_mean"] != 0.0
    # PPO advantages are returns minus values, not group-normalised: the first step's mean is the return's
    assert a[0]["train/adv_mean"] == pytest.approx(a[0]["critic/returns_mean"], abs=1e-4)

    ckpts = Path(full.checkpoint_paths[0]).parent
    assert [c.rollout_id for c in list_checkpoints(str(ckpts))] == [1, 2]
    assert [c.rollout_id for c in list_checkpoints(str(ckpts / "critic"))] == [1, 2]

    # Restart from step 1's checkpoints (policy and critic), as a run killed after that save would.
    save = b_dir / "checkpoints"
    shutil.copytree(ckpts / "iter_0000001", save / "iter_0000001")
    shutil.copytree(ckpts / "critic" / "iter_0000001", save / "critic" / "iter_0000001")
    resumed = train(ppo_config(b_dir, save=str(save), load=str(save)))
    assert [r["step"] for r in resumed.steps] == [2]
    b = resumed.steps[0]
    for key in ("rollout/reward_mean", "rollout/generated_tokens"):
        assert b[key] == a[2][key], key
    for key in (*CRITIC_KEYS, "train/loss", "train/adv_mean"):
        assert b[key] == pytest.approx(a[2][key], rel=1e-4, abs=1e-6), (key, b[key], a[2][key])

    # A policy checkpoint without its critic's (the critic of another step only) is refused, not mixed.
    mixed = tmp_path / "c" / "checkpoints"
    shutil.copytree(ckpts / "iter_0000002", mixed / "iter_0000002")
    shutil.copytree(ckpts / "critic" / "iter_0000001", mixed / "critic" / "iter_0000001")
    with pytest.raises(ConfigError, match="no complete critic checkpoint for rollout 2"):
        train(ppo_config(tmp_path / "c", save=str(mixed), load=str(mixed)))
