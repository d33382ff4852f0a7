"""How CPU cores are split between trainer ranks and the engines that decode beside them."""

from __future__ import annotations

from raygym import Recipe
from raygym.presets import tiny
from raygym.trainer.decisions import cpu_training_threads, overlapping_engine_threads


def test_trainer_threads_share_the_node_and_leave_busy_cores():
    assert cpu_training_threads(2, 1) == 2
    assert cpu_training_threads(16, 4) == 4
    assert cpu_training_threads(2, 4) == 1  # never 0
    assert cpu_training_threads(2, 1, busy_cores=1) == 1
    assert cpu_training_threads(16, 2, busy_cores=4) == 6
    assert cpu_training_threads(2, 1, busy_cores=8) == 1


def test_only_async_engines_overlap_training():
    assert overlapping_engine_threads(None) == 0
    def recipe(**fields):
        return Recipe(**{**tiny().model_dump(), "actor_num_gpus_per_node": 2, **fields})

    assert overlapping_engine_threads(recipe(rollout_num_gpus=2)) == 0  # sync: engines idle while training
    assert overlapping_engine_threads(recipe(rollout_num_gpus=2, async_mode=True)) == 2
    assert overlapping_engine_threads(recipe(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, async_mode=True)) == 2
