"""No silent fallbacks: model parallelism the resolved trainer backend cannot run, pipeline/context
parallelism, a missing megatron-core and an unloadable ``ref_load`` are ConfigErrors (``raygym plan`` shows
them), never a quiet switch to something else."""

from __future__ import annotations

import pytest

from raygym.cli.main import main
from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.errors import ConfigError


def config(**recipe) -> TrainConfig:
    return TrainConfig(recipe=Recipe(**recipe), model=ModelConfig(hf_checkpoint="m"))


def test_torch_backend_refuses_model_parallelism():
    for fields in ({"tensor_model_parallel_size": 2}, {"expert_model_parallel_size": 2},
                   {"tensor_model_parallel_size": 2, "sequence_parallel": True}):
        with pytest.raises(ConfigError, match=r"trainer_backend='torch'.*raygym\[megatron\].*tensor_model_parallel_size=1"):
            config(trainer_backend="torch", **fields)


@pytest.mark.parametrize("field", ["pipeline_model_parallel_size", "context_parallel_size"])
def test_pipeline_and_context_parallel_are_refused_before_anything_runs(field):
    with pytest.raises(ConfigError, match=f"{field}=2: no raygym trainer backend runs it"):
        config(**{field: 2})
    assert main(["plan", "--preset", "qwen3-4b", f"--{field.replace('_', '-')}", "2"]) == 2


def test_auto_with_model_parallelism_is_megatron_and_needs_megatron_core():
    recipe = Recipe(tensor_model_parallel_size=4, sequence_parallel=True, expert_model_parallel_size=8)
    assert recipe.check_trainer_backend() == "megatron"
    assert recipe.check_trainer_backend(megatron_installed=True) == "megatron"
    with pytest.raises(ConfigError, match=r"needs the Megatron backend.*pip install 'raygym\[megatron\]'.*torch"):
        recipe.check_trainer_backend(megatron_installed=False)
    with pytest.raises(ConfigError, match=r"trainer_backend='megatron'.*raygym\[megatron\]"):
        Recipe(trainer_backend="megatron").check_trainer_backend(megatron_installed=False)
    assert Recipe().check_trainer_backend(megatron_installed=False) is None  # auto, decided where trainers run
    assert Recipe(trainer_backend="torch").check_trainer_backend(megatron_installed=False) == "torch"


def test_backend_choice_follows_the_recipe():
    from raygym.trainer import choose_backend

    assert choose_backend("auto", model_parallel=True) == "megatron"
    assert choose_backend("torch", model_parallel=False) == "torch"


def test_plan_shows_the_trainer_backend(capsys):
    assert main(["plan", "--preset", "qwen3-14b"]) == 0
    out = capsys.readouterr().out
    assert "trainer backend: megatron (tensor_model_parallel_size=2, sequence_parallel=True needs it)" in out
    assert main(["plan"]) == 0
    assert "trainer backend: torch" in capsys.readouterr().out  # the tiny preset


def test_unloadable_ref_load_is_a_config_error(tmp_path):
    from raygym.run.driver import _resolve_reference
    from raygym.trainer.backend import TrainerSettings, reference_model_path

    empty = tmp_path / "not-a-model"
    empty.mkdir()
    def settings(recipe: Recipe) -> TrainerSettings:
        return TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="m")))

    with pytest.raises(ConfigError, match=r"ref_load=.*not-a-model.*no config.json"):
        reference_model_path(settings(Recipe(ref_load=str(empty))), "/policy")
    assert reference_model_path(settings(Recipe()), "/policy") == "/policy"  # no ref_load: the initial weights
    cfg = TrainConfig(recipe=Recipe(ref_load=str(tmp_path / "missing")), model=ModelConfig(hf_checkpoint="m"))
    with pytest.raises(ConfigError, match="ref_load="):
        _resolve_reference(cfg, tmp_path)
    (empty / "config.json").write_text("{}")
    assert _resolve_reference(config(ref_load=str(empty)), tmp_path).recipe.ref_load == str(empty)
