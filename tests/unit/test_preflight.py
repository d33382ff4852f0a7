"""Start-up checks without Ray: the facts the banner shows, the builtin task's reward on other data,
no reward at all, writable directories, local model paths; and a ConfigError from an actor's
creation read back from Ray's text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.errors import ConfigError
from raygym.presets import get_base_recipe, qwen3_8b, tiny
from raygym.run.graph import config_error_of, describe_actor_death, plain_text
from raygym.run.preflight import check_writable, preflight

FIXTURE = str(Path(__file__).parents[1] / "fixtures" / "gsm8k_sample.jsonl")


def config(tmp_path: Path, recipe: Recipe | None = None, **dataset) -> TrainConfig:
    return TrainConfig(recipe=recipe or tiny(), model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"),
                       dataset=DatasetConfig(**dataset) if dataset else DatasetConfig(),
                       output_dir=str(tmp_path / "run"))


def test_builtin_run_facts(tmp_path):
    facts = preflight(config(tmp_path))
    assert (facts.data.rows, facts.data.complete) == (1024, True)
    assert [(f.name, f.source) for f in facts.rewards] == [("next_digit", "rm_type")]
    assert (tmp_path / "run").is_dir()  # probed; tiny saves under it (save='')


def test_gsm8k_with_its_reward_and_eval_data(tmp_path):
    cfg = config(tmp_path, tiny().replace(rm_type="gsm8k"), prompt_data=FIXTURE, input_key="question",
                 label_key="answer", eval_prompt_data={"dev": FIXTURE})
    facts = preflight(cfg)
    assert facts.data.rows == 6 and facts.eval_data["dev"].rows == 6
    assert [f.name for f in facts.rewards] == ["gsm8k"]


def test_builtin_task_reward_on_other_data_names_rm_type_and_choices(tmp_path):
    cfg = config(tmp_path, prompt_data=FIXTURE, input_key="question", label_key="answer")
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "rm_type='next_digit'" in message and "--rm-type" in message
    assert all(name in message for name in ("'math'", "'math_verify'", "'gsm8k'", "'exact'"))
    assert not (tmp_path / "run").exists()  # nothing written before the checks passed
    # an explicit custom reward is the user's choice
    ok = config(tmp_path, tiny().replace(custom_rm_function="raygym.rewards.scoring:gsm8k_reward"), prompt_data=FIXTURE,
                input_key="question", label_key="answer")
    assert [f.convention for f in preflight(ok).rewards] == ["fields"]


def test_no_reward_for_own_data(tmp_path):
    cfg = config(tmp_path, qwen3_8b(), prompt_data=FIXTURE, input_key="question", label_key="answer")
    with pytest.raises(ConfigError, match=r"has no reward: pass --rm-type with one of 'math'"):
        preflight(cfg)


def test_rewards_the_rollout_task_gives_pass_preflight_and_show_in_the_banner(tmp_path):
    from raygym.run.display import banner_lines

    judged = tiny().replace(rm_type="judge", judge_hf_checkpoint="builtin:tiny-qwen3")
    episodes = tiny().replace(rm_type="env", rollout_env="raygym.envs.calculator:CalculatorEnv")
    for recipe, shown in ((judged, "the judge engines (builtin:tiny-qwen3)"),
                          (episodes, "the episode reward of raygym.envs.calculator:CalculatorEnv")):
        cfg = config(tmp_path, recipe, prompt_data=FIXTURE, input_key="question", label_key="answer")
        facts = preflight(cfg)
        assert facts.rewards == []  # scored by the rollout task, not by a reward function
        lines = banner_lines(cfg, facts, trainer_backend="torch", engine_kind="raygym", logical_gpus=True)
        assert f"  reward     {shown}" in lines
    with pytest.raises(ConfigError, match=r"rm_type='judges'.*'judge', 'env'"):
        tiny().replace(rm_type="judges")


def test_unwritable_directories(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"save=.*cannot write there \((NotADirectoryError|FileExistsError)"):
        check_writable(str(tmp_path / "file" / "ckpt"), "save", "pass --save ''")
    cfg = config(tmp_path, tiny().replace(save=str(tmp_path / "file" / "ckpt")))
    with pytest.raises(ConfigError, match=r"--save '' to keep checkpoints in the run directory"):
        preflight(cfg)
    check_writable("memory://anything/at/all", "save", "")  # remote URLs are not probed
    probe_dir = tmp_path / "fine"
    check_writable(str(probe_dir), "save", "")
    assert probe_dir.is_dir() and os.listdir(probe_dir) == []  # the probe file is gone


def test_local_model_path_must_exist(tmp_path):
    cfg = TrainConfig(recipe=tiny(), model=ModelConfig(hf_checkpoint=str(tmp_path / "no-model")),
                      output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"hf_checkpoint=.*no such directory"):
        preflight(cfg)


def test_get_base_recipe_takes_a_name_string():
    assert get_base_recipe("Qwen/Qwen3-8B") == qwen3_8b() == get_base_recipe(ModelConfig(hf_checkpoint="Qwen/Qwen3-8B"))
    assert get_base_recipe("builtin:tiny-qwen3") == tiny()
    with pytest.raises(ConfigError, match="registered models"):
        get_base_recipe("meta-llama/Llama-3.1-8B")
    with pytest.raises(ConfigError, match="checkpoint name"):
        get_base_recipe(42)  # type: ignore[arg-type]


class _DiedInInit(Exception):
    """What Ray raises for a call to an actor whose __init__ failed: only the text survives."""

    _actor_init_failed = True


def test_config_error_of_an_actor_creation_failure():
    text = ("The actor died because of an error raised in its creation task, \x1b[36mray::RolloutManager.__init__()"
            "\x1b[39m (pid=1, ip=10.0.0.1)\n  File \"x.py\", line 3, in __init__\n    raise ConfigError(...)\n"
            "raygym.errors.ConfigError: prompt_data='s3://b/d.jsonl' line 1500: not valid JSON; fix line 1500")
    err = config_error_of(_DiedInInit(text))
    assert isinstance(err, ConfigError)
    assert str(err) == "prompt_data='s3://b/d.jsonl' line 1500: not valid JSON; fix line 1500"
    assert config_error_of(_DiedInInit("raygym.errors.RaygymError: boom")) is None
    other = Exception("raygym.errors.ConfigError: x")  # not a creation failure
    assert config_error_of(other) is None
    assert "\x1b" not in describe_actor_death(_DiedInInit(text), None)
    assert plain_text("\x1b[1m\x1b[31mred\x1b[0m") == "red"
