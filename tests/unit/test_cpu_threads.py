"""How CPU cores are split between trainer ranks and the engines that decode beside them."""

from __future__ import annotations

from raygym import ModelConfig, Recipe, TrainConfig
from raygym.presets import tiny
from raygym.trainer.backend import TrainerSettings
from raygym.trainer.decisions import cpu_training_threads


def test_trainer_threads_share_the_node_and_leave_busy_cores():
    assert cpu_training_threads(2, 1) == 2
    assert cpu_training_threads(16, 4) == 4
    assert cpu_training_threads(2, 4) == 1  # never 0
    assert cpu_training_threads(2, 1, busy_cores=1) == 1
    assert cpu_training_threads(16, 2, busy_cores=4) == 6
    assert cpu_training_threads(2, 1, busy_cores=8) == 1


def test_only_async_engines_overlap_training():
    def engine_threads(**fields):
        recipe = Recipe(**{**tiny().model_dump(), "actor_num_gpus_per_node": 2, **fields})
        return TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="m"))).engine_threads

    assert engine_threads(colocate=True) == 0  # colocated: the engines are released while the trainer trains
    assert engine_threads(rollout_num_gpus=2) == 0  # sync: engines idle while training
    assert engine_threads(rollout_num_gpus=2, async_mode=True) == 2
    assert engine_threads(rollout_num_gpus=2, fully_async=True) == 2  # generation never stops
    assert engine_threads(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, async_mode=True) == 2
