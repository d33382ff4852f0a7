"""One schedule setting: ``--schedule`` / ``schedule =`` / ``Recipe(schedule=...)`` and the old mode flags are
spellings of one typed value, ``recipe.schedule``, which the loop, the trainer and the weight sync match on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raygym.config import ConfigError, Recipe, TrainConfig
from raygym.config.schedule import FullyAsync, OneStepOff, Sync
from raygym.presets import tiny
from raygym.run.config_loading import load_train_config
from raygym.run.loop import AsyncSchedule, FullyAsyncSchedule, SyncSchedule, schedule_for


@pytest.mark.parametrize(("flags", "expected"), [
    ([], Sync()),
    (["--schedule", "sync"], Sync()),
    (["--async-mode"], OneStepOff()),
    (["--schedule", "one_step_off"], OneStepOff()),
    (["--fully-async"], FullyAsync(2, "regenerate")),
    (["--schedule", "fully_async", "--max-staleness", "4", "--stale-sample-policy", "drop"], FullyAsync(4, "drop")),
])
def test_the_old_flags_and_schedule_are_spellings_of_one_typed_value(flags, expected):
    cfg = load_train_config(flags)
    assert cfg.recipe.schedule == expected
    assert TrainConfig.from_cli_args(cfg.cli_args()).recipe.schedule == expected  # the round trip keeps it


def test_a_schedule_that_contradicts_a_mode_flag_names_both():
    with pytest.raises(ConfigError, match=r"schedule='sync' and fully_async=True disagree"):
        load_train_config(["--schedule", "sync", "--fully-async"])
    with pytest.raises(ConfigError, match=r"schedule='fully_async' and async_mode=True disagree"):
        Recipe(colocate=False, schedule="fully_async", async_mode=True)
    with pytest.raises(ConfigError, match=r"invalid choice: 'eventually'"):
        load_train_config(["--schedule", "eventually"])
    with pytest.raises(ConfigError, match=r"schedule='often': not a schedule"):
        Recipe(colocate=False, schedule="often")


def test_later_layers_win_over_a_toml_schedule_and_the_preset(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('schedule = "fully_async"\n[recipe]\nmax_staleness = 3\n')
    assert load_train_config(["@", str(run)]).recipe.schedule == FullyAsync(3, "regenerate")
    assert load_train_config(["@", str(run), "--schedule", "one_step_off"]).recipe.schedule == OneStepOff()
    nested = tmp_path / "nested.toml"
    nested.write_text('[recipe]\nschedule = "one_step_off"\n')
    assert load_train_config(["@", str(nested)]).recipe.schedule == OneStepOff()


def test_a_schedule_object_carries_its_bound_and_the_recipe_keeps_its_flat_fields():
    recipe = Recipe(**{**tiny().model_dump(), "schedule": FullyAsync(max_staleness=5, stale_sample_policy="drop")})
    assert (recipe.fully_async, recipe.async_mode, recipe.max_staleness, recipe.stale_sample_policy) == (
        True, False, 5, "drop")
    assert "schedule" not in recipe.model_dump()  # a view of the fields, so model_dump round trips stay exact
    assert Recipe(**{**recipe.model_dump(), "fully_async": False}).schedule == Sync()


def test_the_loop_runs_the_schedule_the_recipe_names():
    base = tiny().model_dump()
    kinds = {name: type(schedule_for(Recipe(**{**base, "schedule": name}), manager=None, last=3))
             for name in ("sync", "one_step_off", "fully_async")}
    assert kinds == {"sync": SyncSchedule, "one_step_off": AsyncSchedule, "fully_async": FullyAsyncSchedule}


def test_plan_prints_the_schedule():
    out = subprocess.run([sys.executable, "-m", "raygym", "plan", "--schedule", "fully_async", "--max-staleness", "3"],
                         capture_output=True, text=True, check=True).stdout
    assert "schedule: fully_async (generation runs up to 3 steps ahead; a group older than that is regenerated)" in out


@pytest.mark.parametrize(("flags", "use_tis"), [
    ([], False),
    (["--async-mode"], True),  # off-policy: TIS on by default, over the preset's use_tis=False
    (["--schedule", "fully_async"], True),
    (["--async-mode", "--no-use-tis"], False),  # an explicit choice stays
    (["--use-tis"], True),
])
def test_an_off_policy_schedule_turns_tis_on_unless_use_tis_is_given(flags, use_tis):
    cfg = load_train_config(flags)
    assert cfg.recipe.use_tis is use_tis
    assert TrainConfig.from_cli_args(cfg.cli_args()).recipe.use_tis is use_tis
    assert Recipe(colocate=False, async_mode=True).use_tis is True  # the Python API: the same default
    assert Recipe(colocate=False, async_mode=True, use_tis=False).use_tis is False
