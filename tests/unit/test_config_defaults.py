"""Every Recipe default against the Qwen3_4B_Recipe reference page, raygym's own fields against
docs/internals.md, and the shape of the model (flat, documented, Modal fields left out)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from raygym import ConfigError, DatasetConfig, MetricsConfig, ModelConfig, Recipe, TrainConfig
from raygym.config.allocation import GpuAllocation

# Transcribed from the Qwen3_4B_Recipe page: every field that is not Modal-only, with its default.
SPEC_DEFAULTS = {
    "sequence_parallel": False,
    "rollout_max_response_len": 4096,
    "rollout_temperature": 1.0,
    "save_interval": 10,
    "colocate": True,
    "tensor_model_parallel_size": 1,
    "rollout_num_gpus_per_engine": 1,
    "num_rollout": 1,
    "start_rollout_id": None,
    "rollout_batch_size": 16,
    "async_mode": False,
    "slime_model_script": "",
    "source_hf_checkpoint": None,
    "megatron_conversion_hf_checkpoint": None,
    "substep_timing": "auto",
    "capture_trace": False,
    "trace_sample_limit": 16,
    "actor_num_nodes": 1,
    "actor_num_gpus_per_node": 8,
    "rollout_num_gpus": None,
    "use_critic": False,
    "critic_num_nodes": None,
    "critic_num_gpus_per_node": None,
    "advantage_estimator": "grpo",
    "n_samples_per_prompt": 8,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "use_kl_loss": False,
    "kl_loss_type": "low_var_kl",
    "kl_loss_coef": 0.0,
    "kl_coef": 0.0,
    "entropy_coef": 0.0,
    "calculate_per_token_loss": False,
    "ref_load": "",
    "over_sampling_batch_size": None,
    "dynamic_sampling_filter_path": None,
    "balance_data": False,
    "rollout_shuffle": True,
    "rollout_top_p": 1.0,
    "rollout_stop_token_ids": None,
    "sglang_mem_fraction_static": 0.75,
    "use_fault_tolerance": True,
    "rollout_health_check_interval": 30,
    "rollout_health_check_timeout": 30,
    "rollout_health_check_first_wait": 300,
    "global_batch_size": 16,
    "lr": 5e-07,
    "lr_decay_style": "constant",
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.98,
    "optimizer": "adam",
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "accumulate_allreduce_grads_in_fp32": True,
    "use_distributed_optimizer": False,
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "use_dynamic_batch_size": True,
    "max_tokens_per_gpu": 8192,
    "qkv_format": "thd",
    "eval_interval": 10,
    "n_samples_per_eval_prompt": 4,
    "eval_max_response_len": 4096,
    "eval_top_p": 1.0,
    "eval_config": None,
    "save": "/checkpoints",
    "load": "",
    "no_save_optim": False,
    "no_load_optim": False,
    "megatron_to_hf_mode": "",
    "freeze_params_name_list": None,
    "update_weight_mode": "full",
    "update_weight_transport": "nccl",
    "update_weight_encoding": "indices",
    "update_weight_disk_dir": "",
    "rm_type": None,
    "custom_rm_function": None,
    "custom_generate_function": None,
    "custom_reward_post_process_function": None,
    "custom_rollout_log_function": None,
    "custom_eval_rollout_log_function": None,
    "rollout_function": None,
    "custom_megatron_before_log_prob_hook": None,
    "custom_megatron_before_train_step_hook": None,
    "sglang_enable_dp_attention": False,
    "sglang_dp_size": None,
    "sglang_ep_size": None,
    "sglang_enable_dp_lm_head": False,
    "sglang_disable_custom_all_reduce": False,
    "sglang_cuda_graph_bs": None,
    "sglang_cuda_graph_backend_prefill": None,
    "sglang_max_running_requests": None,
    "sglang_tool_call_parser": None,
    "sglang_reasoning_parser": None,
    "extra_config": None,
    "sglang_config": None,
    "sglang_request_params": None,
    "apply_chat_template_kwargs": "",
    "train_env_vars": None,
    "multimodal_keys": None,
}
# On the page but with no default shown.
SPEC_NO_DEFAULT = {"environment"}
MODAL_ONLY = {
    "gpu_type", "name", "app_tags", "image_overlay", "local_slime", "slime_git_repository", "slime_git_revision",
    "memory", "cpu", "cloud", "region", "patch_files", "image_run_commands", "image_env", "train_function_kwargs",
}  # fmt: skip
# docs/internals.md: raygym's own Recipe fields.
RAYGYM_DEFAULTS = {
    "trainer_backend": "auto",
    "rollout_engine": "auto",
    "update_weight_buffer_size": 536870912,
    "update_weight_full_interval": 0,
    "update_weight_pause_mode": "abort",
    "update_weight_timeout": 600.0,
    "seed": 1234,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "micro_batch_size": 1,
    "clip_grad": 1.0,
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "lr_decay_iters": None,
    "eps_clip_c": None,
    "use_tis": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "tis_mode": "truncate",
    "tis_level": "token",
    "use_rollout_routing_replay": False,
    "gamma": 1.0,
    "lambd": 1.0,
    "critic_lr": None,
    "value_clip": None,
    "torch_activation_checkpointing": False,
    "distributed_timeout_minutes": 10,
    "rollout_max_prompt_len": None,
    "reward_functions": None,
    "colocate_trainer_gpu_share": 0.5,
    "colocate_engine_gpu_share": 0.4,
    "placement_timeout": 600.0,
    "rollout_engine_python": "",
    "update_weight_probe_tolerance": 0.1,
    "update_weight_double_buffer": False,
    # fully asynchronous training
    "fully_async": False,
    "max_staleness": 2,
    "stale_sample_policy": "regenerate",
    "cpu_placement": "disjoint",
    "cpu_engine_cores": None,
    "auto_split": False,
    "auto_split_probe_steps": 4,
    # LoRA (raygym/lora.py)
    "lora_rank": 0,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "lora_target_modules": "all-linear",
    # environments, LLM judge, on-policy distillation
    "rollout_env": None,
    "rollout_env_max_turns": 4,
    "rollout_env_max_context_len": None,
    "judge_hf_checkpoint": None,
    "judge_num_engines": 1,
    "judge_num_gpus_per_engine": 1,
    "judge_prompt_template": "Rate the response from 0 to 10.\nTask: {prompt}\nResponse: {response}\nScore:",
    "judge_max_response_len": 16,
    "judge_score_min": 0.0,
    "judge_score_max": 10.0,
    "judge_failure_score": 0.0,
    "judge_batch_size": 32,
    "judge_cache_size": 4096,
    "distill_teacher_checkpoint": None,
    "distill_num_gpus": 1,
    "distill_kl_coef": 1.0,
    "distill_task_weight": 1.0,
}

# Field -> default as printed on the reference page (see tests/data/spec/README.md).
SPEC_PAGE_DEFAULTS = Path(__file__).resolve().parents[1] / "data" / "spec" / "qwen3_4b_recipe_defaults.json"


@pytest.mark.parametrize("field, expected", sorted({**SPEC_DEFAULTS, **RAYGYM_DEFAULTS}.items()))
def test_default_matches_reference(field, expected):
    value = getattr(Recipe(), field)
    assert value == expected and type(value) is type(expected), (field, value)


def test_recipe_has_exactly_the_documented_fields():
    fields = set(Recipe.model_fields)
    assert fields >= set(SPEC_DEFAULTS) | SPEC_NO_DEFAULT | set(RAYGYM_DEFAULTS)
    assert not fields & MODAL_ONLY
    assert "metrics" not in fields  # metrics live on TrainConfig
    unexplained = fields - set(SPEC_DEFAULTS) - SPEC_NO_DEFAULT - set(RAYGYM_DEFAULTS)
    assert unexplained == set(), unexplained


def test_every_field_of_every_model_is_documented():
    for model in (Recipe, ModelConfig, DatasetConfig, MetricsConfig, TrainConfig):
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) > 8, f"{model.__name__}.{name}"


def test_defaults_parsed_from_the_reference_page():
    parsed = json.loads(SPEC_PAGE_DEFAULTS.read_text())["defaults"]
    assert len(parsed) > 70  # the page shows a default for 78 fields
    recipe = Recipe()
    for name, raw in parsed.items():
        if name in MODAL_ONLY:
            continue
        expected = {"True": True, "False": False, '""': "", "{}": {}, "[]": []}.get(raw)
        if expected is None:
            expected = float(raw) if re.fullmatch(r"[\d.e+-]+", raw) and not raw.isdigit() else raw
            expected = int(raw) if raw.isdigit() else expected
            if isinstance(expected, str) and expected.startswith('"'):
                expected = expected.strip('"')
        assert getattr(recipe, name) == expected, name


def test_other_model_defaults():
    model = ModelConfig(hf_checkpoint="builtin:tiny-qwen3")
    assert (model.ref_checkpoint, model.dtype, model.tokenizer, model.trust_remote_code) == (
        None,
        "auto",
        None,
        False,
    )
    assert (model.num_experts, model.moe_router_topk, model.num_layers, model.hidden_size) == (
        None,
        None,
        None,
        None,
    )
    data = DatasetConfig()
    assert (data.prompt_data, data.input_key, data.label_key, data.metadata_key) == (
        "builtin:next-digit", "prompt", "label", "metadata",
    )  # fmt: skip
    assert (data.apply_chat_template, data.apply_chat_template_kwargs, data.eval_prompt_data, data.format) == (
        False, {}, {}, "auto",
    )  # fmt: skip
    metrics = MetricsConfig()
    assert (metrics.wandb_project, metrics.wandb_group, metrics.wandb_name, metrics.tensorboard_dir) == (
        None,
    ) * 4
    assert not any("key" in name for name in MetricsConfig.model_fields)


def test_model_checkpoint_is_required():
    with pytest.raises(ConfigError, match="hf_checkpoint"):
        ModelConfig()


def test_run_id_is_minted_once_and_kept():
    cfg = TrainConfig(model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"))
    first = cfg.run_id
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", first)
    assert cfg.run_id == first and cfg.run_dir == f"runs/{first}"
    other = TrainConfig(model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"))
    assert other.run_id != first
    assert TrainConfig(model=cfg.model, run_id=None).run_id != first  # None means "mint one"


def test_run_and_checkpoint_dirs():
    cfg = TrainConfig(
        model=ModelConfig(hf_checkpoint="m"), output_dir="s3://bucket/run7/", recipe=Recipe(save="")
    )
    assert cfg.run_dir == "s3://bucket/run7/"
    assert cfg.checkpoint_dir == "s3://bucket/run7/checkpoints"
    assert TrainConfig(model=cfg.model).checkpoint_dir == "/checkpoints"


def test_gpu_allocation_type_is_reexported():
    from raygym.config import GpuAllocation as FromConfig

    assert FromConfig is GpuAllocation
    assert isinstance(Recipe().gpu_allocation(), GpuAllocation)
