"""Presets: valid recipes with the reference values, the model they expect, and name lookup."""

from __future__ import annotations

import pytest

from raygym import ConfigError, ModelConfig, Recipe, TrainConfig
from raygym.builtin import TINY_MODEL
from raygym.presets import (
    PRESETS,
    default_model,
    get_base_recipe,
    get_preset,
    qwen3_4b,
    qwen3_14b,
    qwen3_30b_a3b,
    qwen3_32b,
    tiny,
)

# preset -> (nodes, actor GPUs, colocated, engines, GPUs per engine, TP, sequence parallel)
LAYOUTS = {
    "qwen3-0.6b": (1, 8, True, 8, 1, 1, False),
    "qwen3-1.7b": (1, 8, True, 8, 1, 1, False),
    "qwen3-4b": (1, 8, True, 8, 1, 1, False),
    "qwen3-8b": (1, 8, True, 8, 1, 1, False),
    "qwen3-14b": (1, 8, True, 4, 2, 2, True),
    "qwen3-32b": (1, 8, True, 2, 4, 4, True),
    "qwen3-30b-a3b": (2, 8, False, 2, 4, 4, True),
    "tiny": (2, 1, False, 1, 1, 1, False),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_preset_layouts(name):
    recipe = PRESETS[name]()
    alloc = recipe.gpu_allocation()
    got = (alloc.total_nodes, alloc.actor_gpus, alloc.colocate, alloc.rollout_engines,
           alloc.rollout_num_gpus_per_engine, recipe.tensor_model_parallel_size, recipe.sequence_parallel)  # fmt: skip
    assert got == LAYOUTS[name]
    # each preset is a complete, valid training config with the model it is made for
    cfg = TrainConfig(recipe=recipe, model=default_model(name))
    assert TrainConfig.from_cli_args(cfg.cli_args()) == cfg


def test_qwen3_4b_is_the_reference_page():
    assert qwen3_4b() == Recipe()
    assert (qwen3_4b().rollout_batch_size, qwen3_4b().lr, qwen3_4b().max_tokens_per_gpu) == (16, 5e-07, 8192)


def test_reference_values_of_larger_models():
    assert (
        qwen3_14b().rollout_batch_size,
        qwen3_14b().sglang_mem_fraction_static,
        qwen3_14b().max_tokens_per_gpu,
    ) == (8, 0.7, 4608)
    assert (
        qwen3_32b().rollout_batch_size,
        qwen3_32b().sglang_mem_fraction_static,
        qwen3_32b().max_tokens_per_gpu,
    ) == (4, 0.65, 4096)
    moe = qwen3_30b_a3b()
    assert (moe.expert_model_parallel_size, moe.rollout_num_gpus) == (8, 8)
    moe.validate_model_parallelism(default_model("qwen3-30b-a3b"))


def test_tiny_preset_values():
    r = tiny()
    assert (r.actor_num_nodes, r.actor_num_gpus_per_node, r.colocate, r.rollout_num_gpus) == (1, 1, False, 1)
    assert (r.trainer_backend, r.rollout_engine, r.rm_type) == ("torch", "raygym", "next_digit")
    assert (r.rollout_batch_size, r.n_samples_per_prompt, r.global_batch_size) == (16, 8, 128)
    assert (r.rollout_max_response_len, r.eval_max_response_len, r.num_rollout) == (8, 8, 100)
    assert (r.lr, r.weight_decay, r.eval_interval, r.save, r.save_interval) == (2e-3, 0.0, None, "", 20)
    assert (r.use_fault_tolerance, r.rollout_health_check_first_wait) == (True, 5)
    assert r.update_weight_buffer_size == 16 * 1024 * 1024
    assert default_model("tiny").hf_checkpoint == TINY_MODEL


@pytest.mark.parametrize("alias", ["qwen3-4b", "qwen3_4b", "Qwen3-4B", "QWEN3_4B"])
def test_registry_accepts_both_spellings(alias):
    assert alias in PRESETS and PRESETS[alias] is qwen3_4b and get_preset(alias) == Recipe()


def test_registry_small_models_spellings():
    assert PRESETS["qwen3-0.6b"] is PRESETS["qwen3_0_6b"]
    assert PRESETS["qwen3_30b_a3b"] is qwen3_30b_a3b
    assert "qwen3-5b" not in PRESETS and PRESETS.get("qwen3-5b") is None


@pytest.mark.parametrize(
    "checkpoint, preset",
    [("Qwen/Qwen3-4B", "qwen3-4b"), ("/models/Qwen3-4B", "qwen3-4b"), ("/models/Qwen3-4B/", "qwen3-4b"),
     ("s3://bucket/Qwen3-8B", "qwen3-8b"), ("Qwen/Qwen3-0.6B", "qwen3-0.6b"), ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
     ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b"), ("Qwen/Qwen3-32B", "qwen3-32b"), (TINY_MODEL, "tiny")],
)  # fmt: skip
def test_get_base_recipe_maps_checkpoints(checkpoint, preset):
    assert get_base_recipe(ModelConfig(hf_checkpoint=checkpoint)) == PRESETS[preset]()


def test_unknown_model_lists_the_registered_ones():
    with pytest.raises(ConfigError) as info:
        get_base_recipe(ModelConfig(hf_checkpoint="meta-llama/Llama-3.1-8B"))
    message = str(info.value)
    assert "Llama-3.1-8B" in message and "Qwen/Qwen3-4B" in message and TINY_MODEL in message
    with pytest.raises(ConfigError, match="registered presets: .*qwen3-4b"):
        get_preset("llama")
    with pytest.raises(ConfigError, match="registered presets"):
        default_model("llama")


def test_default_models_are_hf_ids():
    assert default_model("qwen3_4b").hf_checkpoint == "Qwen/Qwen3-4B"
    moe = default_model("qwen3-30b-a3b")
    assert (moe.hf_checkpoint, moe.num_experts, moe.moe_router_topk) == ("Qwen/Qwen3-30B-A3B", 128, 8)
