"""raygym eval before any Ray: what a checkpoint argument resolves to (run dir, save dir, one checkpoint,
HF dir, builtin), the eval config built from the run's config plus flags, and the pass@k / table maths.
The eval itself runs in tests/e2e/test_after_training.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raygym.checkpoint.model_source import resolve_model_source
from raygym.checkpoint.store import save_checkpoint
from raygym.config import DatasetConfig, ModelConfig, TrainConfig
from raygym.errors import ConfigError
from raygym.presets import qwen3_4b, qwen3_30b_a3b, tiny
from raygym.rewards.scoring import pass_at_k
from raygym.run.config_loading import load_train_config
from raygym.run.evaluate import dataset_name, engine_allocation, pass_ks, plan_eval, summarize, take_options
from raygym.types import Sample


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path):
    """A run directory as `raygym train` leaves it: config.json and two complete checkpoints."""
    from safetensors.torch import load_file

    run = tmp_path_factory.mktemp("evalplan") / "run"
    hf_source = tiny_model_path
    cfg = TrainConfig(recipe=tiny().replace(seed=77, eval_interval=5, n_samples_per_eval_prompt=4),
                      model=ModelConfig(hf_checkpoint=hf_source),
                      dataset=DatasetConfig(eval_prompt_data={"digits": "builtin:next-digit"}),
                      output_dir=str(run), run_id="plan-run")
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_json_dict()))
    state = load_file(f"{hf_source}/model.safetensors")
    for step in (4, 9):
        save_checkpoint(str(run / "checkpoints"), step, model_state=state, extra={}, hf_source=hf_source)
    return run


def test_sources_resolve_to_an_hf_dir_and_the_step(run_dir, tmp_path):
    from_run = resolve_model_source(str(run_dir))
    assert (from_run.kind, from_run.rollout_id, from_run.run_dir) == ("checkpoint", 9, str(run_dir))
    assert from_run.checkpoint.endswith("iter_0000009") and from_run.name == "plan-run-iter_0000009"
    assert from_run.hf_dir.startswith(str(run_dir / "cache" / "exports"))
    assert from_run.run_config["recipe"]["seed"] == 77
    weights = sorted(p.name for p in Path(from_run.hf_dir).iterdir())
    assert "config.json" in weights and any(w.endswith(".safetensors") for w in weights)
    assert resolve_model_source(str(run_dir)).hf_dir == from_run.hf_dir  # the export is reused

    from_save_dir = resolve_model_source(str(run_dir / "checkpoints"))
    assert (from_save_dir.rollout_id, from_save_dir.run_dir) == (9, str(run_dir))
    one = resolve_model_source(str(run_dir / "checkpoints" / "iter_0000004"))
    assert (one.rollout_id, one.run_dir, one.run_config["run_id"]) == (4, str(run_dir), "plan-run")
    hf = resolve_model_source(from_run.hf_dir)
    assert (hf.kind, hf.hf_dir, hf.rollout_id) == ("hf", from_run.hf_dir, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a run directory"):
        resolve_model_source(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="nothing there"):
        resolve_model_source(str(tmp_path / "absent"))


def test_plan_reuses_the_run_config_then_the_flags(run_dir, tmp_path):
    plan = plan_eval(str(run_dir), [])
    assert plan.rollout_id == 9 and plan.datasets == {"digits": "builtin:next-digit"}
    assert plan.cfg.recipe.seed == 77 and plan.cfg.recipe.n_samples_per_eval_prompt == 4
    assert plan.cfg.model.hf_checkpoint == plan.source.hf_dir
    assert plan.output_dir == f"{run_dir}/eval/iter_0000009"

    data = tmp_path / "my_test.jsonl"
    data.write_text(json.dumps({"prompt": "next:1=", "label": "2"}) + "\n")
    plan = plan_eval(str(run_dir / "checkpoints" / "iter_0000004"),
                     ["--prompt-data", str(data), "--n-samples-per-eval-prompt", "8", "--step=2", "--out", "o"])
    assert plan.datasets == {"my_test": str(data)} and plan.cfg.dataset.prompt_data == str(data)
    assert (plan.rollout_id, plan.output_dir, plan.cfg.recipe.n_samples_per_eval_prompt) == (2, "o", 8)
    assert plan.cfg.recipe.seed == 77

    # the flag empties the run's eval datasets: a run on the builtin task falls back on its held-out split
    plan = plan_eval(str(run_dir), ["--eval-prompt-data", "{}"])
    assert plan.datasets == {"next-digit": "builtin:next-digit#eval"}
    with pytest.raises(ConfigError, match="step"):
        plan_eval(str(run_dir), ["--step", "x"])


def test_option_splitting_and_names():
    assert take_options(["--prompt-data", "a.jsonl", "--lr", "1e-6"]) == (["--lr", "1e-6"], {"--prompt-data": "a.jsonl"})
    with pytest.raises(ConfigError, match="--out"):
        take_options(["--out"])
    assert dataset_name("/data/gsm8k.test.jsonl") == "gsm8k"


def test_engine_only_allocation_keeps_the_engines():
    for recipe in (tiny(), qwen3_4b(), qwen3_30b_a3b()):
        full, only = recipe.gpu_allocation(), engine_allocation(recipe)
        assert (only.rollout_engines, only.rollout_num_gpus_per_engine) == (full.rollout_engines,
                                                                            full.rollout_num_gpus_per_engine)
        assert only.total_gpus == full.rollout_gpus and only.critic_gpus == 0


def test_summarize_adds_unbiased_pass_at_k():
    n = 4
    rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    samples = [Sample(prompt="p", prompt_tokens=[1], group_index=-1, sample_index=j, reward=float(r),
                      response_tokens=[1, 2], finish_reason="stop")
               for group in rewards for j, r in enumerate(group)]
    row = {"eval/d/reward_mean": 5 / 12, "eval/d/pass@4": 2 / 3, "eval/d/pass@1": 5 / 12,
           "eval/d/response_len_mean": 2.0, "eval/d/truncated_frac": 0.0}
    extra, table = summarize({"d": samples}, n, 1.0, row)
    assert list(extra) == ["eval/d/pass@2"]
    assert math.isclose(extra["eval/d/pass@2"], (pass_at_k(4, 1, 2) + 1.0 + 0.0) / 3)
    assert table == [{"dataset": "d", "prompts": 3, "samples": 12, "reward_mean": 5 / 12, "pass@1": 5 / 12,
                      "pass@2": extra["eval/d/pass@2"], "pass@4": 2 / 3, "response_len_mean": 2.0,
                      "truncated_frac": 0.0}]
    assert pass_ks(16) == [1, 2, 4, 8, 16]


def test_the_builtin_task_has_a_held_out_eval_split_used_by_default(tmp_path):
    from raygym.builtin import materialize_dataset
    from raygym.data.prompts import eval_dataset_urls

    cfg = load_train_config([])  # what `raygym train` with no flags runs
    assert eval_dataset_urls(cfg) == {"next-digit": "builtin:next-digit#eval"}
    train_rows = materialize_dataset("builtin:next-digit", tmp_path)
    eval_rows = materialize_dataset("builtin:next-digit#eval", tmp_path)
    assert train_rows != eval_rows and len(open(eval_rows).read().splitlines()) == 64
    named = load_train_config(["--eval-prompt-data", '{"mine": "x.jsonl"}'])
    assert eval_dataset_urls(named) == {"mine": "x.jsonl"}  # named eval data replaces the default
    own = load_train_config(["--prompt-data", "x.jsonl", "--rm-type", "exact"])
    assert eval_dataset_urls(own) == {}  # other data has no split to hold out: raygym eval asks for one


def test_the_eval_table_never_cuts_a_number_in_a_narrow_pipe():
    import io

    from rich.console import Console

    from raygym.run.evaluate import render_table

    rows = [{"dataset": "next-digit-with-a-long-name", "prompts": 64, "reward_mean": 0.123456789,
             "pass@1": 0.0456, "response_len_mean": 7.4375}]
    out = io.StringIO()
    Console(file=out, width=30, force_terminal=False).print(render_table(rows, "eval"))
    text = out.getvalue()
    assert "…" not in text
    flat = text.replace("│", "").replace("\n", "").replace(" ", "")
    for value in ("0.1235", "0.0456", "7.4375", "64"):
        assert value in flat, text
