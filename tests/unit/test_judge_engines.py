"""The judge's engines on vLLM: a context that holds the longest judge prompt, and a judge model vLLM's CPU
attention cannot run refused before Ray starts (the engines of other kinds start as the rollout engines do)."""

from __future__ import annotations

import pytest
import torch

from raygym.builtin import TINY_MODEL, materialize_model
from raygym.config import Recipe
from raygym.engines.launch.vllm import max_model_len
from raygym.errors import ConfigError
from raygym.run.aux_groups import JUDGE_LABEL_TOKENS, judge_engine_recipe, preflight_judge

RECIPE = Recipe(rollout_max_prompt_len=40, rollout_max_response_len=24, eval_max_response_len=30, eval_interval=5,
                judge_hf_checkpoint="builtin:tiny-qwen3", judge_batch_size=100, judge_max_response_len=12,
                judge_num_gpus_per_engine=2, judge_prompt_template="Rate {response} for {prompt} ({label}):")


def test_the_judge_engines_recipe():
    raygym = judge_engine_recipe(RECIPE, "raygym")
    assert (raygym.rollout_num_gpus_per_engine, raygym.sglang_max_running_requests) == (2, 100)
    assert raygym.rollout_max_prompt_len == 40  # other kinds size their context from the model
    vllm = judge_engine_recipe(RECIPE, "vllm")
    longest_prompt = 40 + 30 + len(RECIPE.judge_prompt_template) + JUDGE_LABEL_TOKENS  # eval answers are longer
    assert max_model_len(vllm) == longest_prompt + 12
    assert (vllm.rollout_num_gpus_per_engine, vllm.sglang_max_running_requests) == (2, 100)


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's head-size limit is its CPU attention's")
def test_a_judge_vllm_cannot_run_on_cpu_is_refused_before_ray(tmp_path):
    with pytest.raises(ConfigError, match=r"judge_hf_checkpoint with rollout_engine='vllm'.*head_dim=16"):
        preflight_judge(RECIPE, "vllm", tmp_path / "cache")  # the builtin tiny model: head size 16
    preflight_judge(RECIPE, "raygym", tmp_path / "cache")  # raygym's server runs any head size
    wide = materialize_model(TINY_MODEL, tmp_path / "wide", seed=0, head_dim=32)
    preflight_judge(RECIPE.replace(judge_hf_checkpoint=wide), "vllm", tmp_path / "cache")
