"""The trainer's view carries its own section, not the recipe: the loss view, the Megatron fields and the engine
threads are built in ``TrainerSettings.from_config``; the recipe itself only rides along as the first argument of a
``custom_megatron_*`` hook, when one is set, and only ``call_hook`` reads it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from raygym.algo.rl_loss import RLLossConfig
from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.config.recipe_checks import check_trainer_backend, model_parallel_requests
from raygym.trainer.backend import TrainerSettings
from raygym.trainer.megatron_model import MegatronOptions

ROOT = Path(__file__).resolve().parents[2]


def settings(**fields: object) -> TrainerSettings:
    return TrainerSettings.from_config(TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint="m")))


def hook(args: object, rollout_id: int, batch: object) -> object:
    return batch


def test_the_view_holds_no_recipe_but_what_was_read_from_it():
    names = {f.name for f in dataclasses.fields(TrainerSettings)}
    assert "recipe" not in names
    s = settings(eps_clip_high=0.3, tensor_model_parallel_size=2, qkv_format="bshd", trainer_backend="megatron")
    assert s.loss == RLLossConfig.from_recipe(Recipe(eps_clip_high=0.3)) and s.loss.eps_clip_high == 0.3
    assert s.hook_recipe is None  # no hook: the recipe does not travel to the trainers
    assert MegatronOptions.from_settings(s) == MegatronOptions.from_recipe(
        Recipe(tensor_model_parallel_size=2, qkv_format="bshd", trainer_backend="megatron"), "auto")
    # the backend choice reads the view as it reads a recipe
    assert model_parallel_requests(s) == ["tensor_model_parallel_size=2"]
    assert check_trainer_backend(s, megatron_installed=True) == "megatron"


def test_engine_threads_count_the_engines_decoding_while_training():
    assert settings().engine_threads == 0  # synchronous: the engines are idle during a train step
    overlapped = dict(async_mode=True, colocate=False, rollout_num_gpus=3, actor_num_gpus_per_node=1)
    assert settings(**overlapped).engine_threads == 3
    assert settings(**{**overlapped, "async_mode": False}).engine_threads == 0


def test_a_hook_gets_the_recipe_and_only_call_hook_reads_it():
    recipe = Recipe(custom_megatron_before_train_step_hook=hook)
    s = TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="m")))
    assert s.hook_recipe is recipe
    readers = []
    for path in (ROOT / "raygym").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "hook_recipe" and isinstance(node.ctx, ast.Load):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == ["raygym/trainer/backend.py"]
    source = (ROOT / "raygym/trainer/backend.py").read_text()
    call_hook = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "call_hook")
    assert "hook_recipe" in ast.unparse(call_hook)
