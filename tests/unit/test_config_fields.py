"""Every config field is implemented or refused: each one a component reads (the module named here reads
it as an attribute of the typed config or of a typed view built of it, see ``config_reads``), or a field
raygym does not run, which a non-default value turns into a ConfigError with the reason. The views themselves
are well formed, and no component reads the config by name with a default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from raygym.config import DatasetConfig, MetricsConfig, ModelConfig, Recipe, TrainConfig
from raygym.config.constants import UNSUPPORTED_MODEL_FIELDS, UNSUPPORTED_RECIPE_FIELDS
from raygym.config.views import build_view, view_extras, view_problems
from raygym.errors import ConfigError
from raygym.run.config_loading import load_train_config
from tests.unit.config_reads import VIEWS, fields_read, reads_field

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"Recipe": Recipe, "ModelConfig": ModelConfig, "DatasetConfig": DatasetConfig, "MetricsConfig": MetricsConfig}
REFUSED = {"Recipe": UNSUPPORTED_RECIPE_FIELDS, "ModelConfig": UNSUPPORTED_MODEL_FIELDS}

# model -> field -> a module that reads it (one of possibly several)
READ_BY = {
    "Recipe": {
        "multimodal_keys": "raygym/data/prompts.py",
        "actor_num_nodes": "raygym/config/recipe_fields.py",
        "actor_num_gpus_per_node": "raygym/config/recipe_fields.py",
        "colocate": "raygym/run/loop.py",
        "cpu_placement": "raygym/engines/launch/sglang.py",
        "cpu_engine_cores": "raygym/config/recipe.py",
        "auto_split": "raygym/run/driver.py",
        "auto_split_probe_steps": "raygym/run/driver.py",
        "rollout_num_gpus": "raygym/config/recipe_fields.py",
        "rollout_num_gpus_per_engine": "raygym/engines/actor.py",
        "tensor_model_parallel_size": "raygym/trainer/megatron_model.py",
        "sequence_parallel": "raygym/trainer/megatron_model.py",
        "pipeline_model_parallel_size": "raygym/trainer/megatron_model.py",
        "context_parallel_size": "raygym/trainer/megatron_model.py",
        "expert_model_parallel_size": "raygym/trainer/megatron_model.py",
        "use_critic": "raygym/run/graph.py",
        "critic_num_nodes": "raygym/config/recipe_fields.py",
        "critic_num_gpus_per_node": "raygym/config/recipe_fields.py",
        "trainer_backend": "raygym/trainer/actor.py",
        "rollout_engine": "raygym/run/graph.py",
        "colocate_trainer_gpu_share": "raygym/cluster/placement.py",
        "colocate_engine_gpu_share": "raygym/cluster/placement.py",
        "placement_timeout": "raygym/cluster/placement.py",
        "async_mode": "raygym/config/recipe.py",
        "fully_async": "raygym/config/recipe.py",
        "max_staleness": "raygym/config/recipe.py",
        "stale_sample_policy": "raygym/config/recipe.py",
        "environment": "raygym/run/graph.py",
        "train_env_vars": "raygym/run/graph.py",
        "advantage_estimator": "raygym/run/driver.py",
        "n_samples_per_prompt": "raygym/rollout/manager.py",
        "eps_clip": "raygym/algo/rl_loss.py",
        "eps_clip_high": "raygym/algo/rl_loss.py",
        "eps_clip_c": "raygym/algo/rl_loss.py",
        "use_kl_loss": "raygym/algo/rl_loss.py",
        "kl_loss_type": "raygym/algo/rl_loss.py",
        "kl_loss_coef": "raygym/algo/rl_loss.py",
        "kl_coef": "raygym/run/loop.py",
        "entropy_coef": "raygym/algo/rl_loss.py",
        "calculate_per_token_loss": "raygym/algo/rl_loss.py",
        "ref_load": "raygym/run/driver.py",
        "use_tis": "raygym/algo/rl_loss.py",
        "use_rollout_routing_replay": "raygym/trainer/torch_backend.py",
        "tis_clip": "raygym/algo/rl_loss.py",
        "tis_clip_low": "raygym/algo/rl_loss.py",
        "tis_mode": "raygym/algo/rl_loss.py",
        "tis_level": "raygym/algo/rl_loss.py",
        "gamma": "raygym/run/loop.py",
        "lambd": "raygym/run/loop.py",
        "critic_lr": "raygym/trainer/critic.py",
        "value_clip": "raygym/trainer/critic.py",
        "num_rollout": "raygym/run/driver.py",
        "start_rollout_id": "raygym/trainer/actor.py",
        "rollout_batch_size": "raygym/rollout/manager.py",
        "rollout_max_response_len": "raygym/rollout/manager.py",
        "rollout_max_prompt_len": "raygym/data/prompts.py",
        "rollout_temperature": "raygym/rollout/manager.py",
        "rollout_top_p": "raygym/rollout/manager.py",
        "rollout_stop_token_ids": "raygym/rollout/manager.py",
        "rollout_shuffle": "raygym/data/prompts.py",
        "over_sampling_batch_size": "raygym/rollout/dynamic_sampling.py",
        "dynamic_sampling_filter_path": "raygym/rollout/manager.py",
        "balance_data": "raygym/trainer/torch_backend.py",
        "rm_type": "raygym/rewards/scoring.py",
        "reward_functions": "raygym/rewards/scoring.py",
        "capture_trace": "raygym/rollout/manager.py",
        "trace_sample_limit": "raygym/rollout/manager.py",
        "substep_timing": "raygym/run/driver.py",
        "use_fault_tolerance": "raygym/rollout/manager.py",
        "rollout_health_check_interval": "raygym/rollout/manager.py",
        "rollout_health_check_timeout": "raygym/rollout/manager.py",
        "rollout_health_check_first_wait": "raygym/rollout/manager.py",
        "global_batch_size": "raygym/trainer/torch_backend.py",
        "micro_batch_size": "raygym/trainer/torch_backend.py",
        "lr": "raygym/trainer/torch_backend.py",
        "min_lr": "raygym/trainer/torch_backend.py",
        "lr_warmup_iters": "raygym/trainer/torch_backend.py",
        "lr_decay_iters": "raygym/trainer/torch_backend.py",
        "lr_decay_style": "raygym/trainer/torch_backend.py",
        "weight_decay": "raygym/trainer/torch_backend.py",
        "adam_beta1": "raygym/trainer/torch_backend.py",
        "adam_beta2": "raygym/trainer/torch_backend.py",
        "optimizer": "raygym/trainer/torch_backend.py",
        "clip_grad": "raygym/trainer/torch_backend.py",
        "seed": "raygym/trainer/torch_backend.py",
        "freeze_params_name_list": "raygym/trainer/torch_backend.py",
        "lora_rank": "raygym/lora.py",
        "lora_alpha": "raygym/lora.py",
        "lora_dropout": "raygym/lora.py",
        "lora_target_modules": "raygym/lora.py",
        "attention_dropout": "raygym/trainer/torch_backend.py",
        "hidden_dropout": "raygym/trainer/megatron_model.py",
        "attention_softmax_in_fp32": "raygym/trainer/megatron_model.py",
        "accumulate_allreduce_grads_in_fp32": "raygym/trainer/megatron_backend.py",
        "use_distributed_optimizer": "raygym/trainer/megatron_backend.py",
        "recompute_granularity": "raygym/trainer/megatron_model.py",
        "recompute_method": "raygym/trainer/megatron_model.py",
        "recompute_num_layers": "raygym/trainer/megatron_model.py",
        "torch_activation_checkpointing": "raygym/trainer/torch_backend.py",
        "distributed_timeout_minutes": "raygym/trainer/megatron_backend.py",
        "use_dynamic_batch_size": "raygym/trainer/torch_backend.py",
        "max_tokens_per_gpu": "raygym/trainer/torch_backend.py",
        "qkv_format": "raygym/trainer/megatron_model.py",
        "eval_interval": "raygym/run/loop.py",
        "n_samples_per_eval_prompt": "raygym/rollout/manager.py",
        "eval_max_response_len": "raygym/rollout/manager.py",
        "eval_top_p": "raygym/rollout/manager.py",
        "eval_config": "raygym/data/prompts.py",
        "save": "raygym/trainer/actor.py",
        "save_interval": "raygym/run/loop.py",
        "load": "raygym/trainer/actor.py",
        "no_save_optim": "raygym/trainer/actor.py",
        "no_load_optim": "raygym/trainer/actor.py",
        "update_weight_mode": "raygym/weightsync/sender.py",
        "update_weight_transport": "raygym/weightsync/sender.py",
        "update_weight_encoding": "raygym/weightsync/sender.py",
        "update_weight_disk_dir": "raygym/weightsync/sender.py",
        "update_weight_buffer_size": "raygym/weightsync/sender.py",
        "update_weight_full_interval": "raygym/weightsync/coordinator.py",
        "update_weight_pause_mode": "raygym/weightsync/coordinator.py",
        "update_weight_double_buffer": "raygym/weightsync/coordinator.py",
        "update_weight_timeout": "raygym/weightsync/sender.py",
        "update_weight_probe_tolerance": "raygym/weightsync/coordinator.py",
        "custom_rm_function": "raygym/rewards/scoring.py",
        "custom_generate_function": "raygym/rollout/manager.py",
        "custom_reward_post_process_function": "raygym/rewards/scoring.py",
        "custom_rollout_log_function": "raygym/run/loop.py",
        "custom_eval_rollout_log_function": "raygym/run/loop.py",
        "rollout_function": "raygym/rollout/manager.py",
        "custom_megatron_before_log_prob_hook": "raygym/trainer/backend.py",
        "custom_megatron_before_train_step_hook": "raygym/trainer/backend.py",
        "rollout_env": "raygym/rollout/tasks.py",
        "rollout_env_max_turns": "raygym/rollout/tasks.py",
        "rollout_env_max_context_len": "raygym/rollout/tasks.py",
        "judge_hf_checkpoint": "raygym/run/aux_groups.py",
        "judge_num_engines": "raygym/run/aux_groups.py",
        "judge_num_gpus_per_engine": "raygym/run/aux_groups.py",
        "judge_prompt_template": "raygym/rewards/judge.py",
        "judge_max_response_len": "raygym/rewards/judge.py",
        "judge_score_min": "raygym/rewards/judge.py",
        "judge_score_max": "raygym/rewards/judge.py",
        "judge_failure_score": "raygym/rewards/judge.py",
        "judge_batch_size": "raygym/rewards/judge.py",
        "judge_cache_size": "raygym/rewards/judge.py",
        "distill_teacher_checkpoint": "raygym/run/aux_groups.py",
        "distill_num_gpus": "raygym/run/aux_groups.py",
        "distill_kl_coef": "raygym/run/loop.py",
        "distill_task_weight": "raygym/run/loop.py",
        "sglang_mem_fraction_static": "raygym/engines/launch/sglang.py",
        "sglang_enable_dp_attention": "raygym/engines/launch/sglang.py",
        "sglang_dp_size": "raygym/engines/launch/sglang.py",
        "sglang_ep_size": "raygym/engines/launch/sglang.py",
        "sglang_enable_dp_lm_head": "raygym/engines/launch/sglang.py",
        "sglang_disable_custom_all_reduce": "raygym/engines/launch/sglang.py",
        "sglang_cuda_graph_bs": "raygym/engines/launch/sglang.py",
        "sglang_cuda_graph_backend_prefill": "raygym/engines/launch/sglang.py",
        "sglang_max_running_requests": "raygym/engines/launch/sglang.py",
        "sglang_tool_call_parser": "raygym/engines/launch/sglang.py",
        "sglang_reasoning_parser": "raygym/engines/launch/sglang.py",
        "sglang_config": "raygym/engines/launch/sglang.py",
        "sglang_request_params": "raygym/rollout/manager.py",
        "rollout_engine_python": "raygym/engines/actor.py",
        "extra_config": "raygym/config/recipe_fields.py",
        "apply_chat_template_kwargs": "raygym/config/run.py",
    },
    "ModelConfig": {
        "hf_checkpoint": "raygym/run/driver.py",
        "ref_checkpoint": "raygym/trainer/backend.py",
        "dtype": "raygym/trainer/backend.py",
        "num_experts": "raygym/trainer/backend.py",
        "moe_router_topk": "raygym/trainer/backend.py",
        "num_layers": "raygym/trainer/backend.py",
        "hidden_size": "raygym/trainer/backend.py",
    },
    "DatasetConfig": {
        "prompt_data": "raygym/cli/main.py",
        "input_key": "raygym/data/prompts.py",
        "label_key": "raygym/data/prompts.py",
        "metadata_key": "raygym/data/prompts.py",
        "apply_chat_template": "raygym/data/prompts.py",
        "apply_chat_template_kwargs": "raygym/config/run.py",
        "eval_prompt_data": "raygym/data/prompts.py",
        "format": "raygym/data/prompts.py",
    },
    "MetricsConfig": {
        "wandb_project": "raygym/run/metrics.py",
        "wandb_group": "raygym/run/metrics.py",
        "wandb_name": "raygym/run/metrics.py",
        "wandb_mode": "raygym/run/metrics.py",
        "tensorboard_dir": "raygym/run/metrics.py",
    },
}


def test_every_field_is_read_or_refused():
    for name, model in MODELS.items():
        read, refused = set(READ_BY[name]), set(REFUSED.get(name, {}))
        assert not read & refused, (name, read & refused)
        assert read | refused == set(model.model_fields), (name, set(model.model_fields) ^ (read | refused))


@pytest.mark.parametrize("model, field", [(m, f) for m, fields in READ_BY.items() for f in fields])
def test_the_named_module_reads_the_field(model, field):
    assert reads_field(READ_BY[model][field], MODELS[model], field), f"{READ_BY[model][field]} does not read {field}"


def test_a_read_is_an_attribute_of_a_typed_config_not_a_name_in_a_string(tmp_path):
    reader = tmp_path / "reader.py"
    reader.write_text(
        "from raygym.config import TrainConfig\n"
        "from raygym.trainer.backend import TrainerSettings\n"
        "MANIFEST = {'format': 'raygym-checkpoint/2'}  # a key, no read\n"
        "def f(cfg: TrainConfig, other, settings: TrainerSettings):\n"
        "    other.num_rollout  # an object of no known type\n"
        "    data = cfg.dataset\n"
        "    return data.format, cfg.recipe.seed, settings.lr, getattr(cfg.model, 'dtype')\n"
    )
    from raygym.trainer.backend import TrainerSettings

    assert fields_read(reader) == {(TrainConfig, "dataset"), (TrainConfig, "recipe"), (TrainConfig, "model"),
                                   (DatasetConfig, "format"), (Recipe, "seed"), (TrainerSettings, "lr")}
    assert reads_field(str(reader), Recipe, "lr") and not reads_field(str(reader), ModelConfig, "dtype")
    # checkpoint.py writes a manifest key named "format"; no DatasetConfig is read there
    assert '"format"' in (ROOT / "raygym/checkpoint/store.py").read_text()
    assert not reads_field("raygym/checkpoint/store.py", DatasetConfig, "format")


REFUSED_VALUES = {
    "megatron_to_hf_mode": "bridge",
    "slime_model_script": "model_args.sh",
    "source_hf_checkpoint": "Qwen/Qwen3-4B",
    "megatron_conversion_hf_checkpoint": "Qwen/Qwen3-4B",
    "multimodal_keys": {"image": "img"},
    "tokenizer": "Qwen/Qwen3-4B",
    "trust_remote_code": True,
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_RECIPE_FIELDS))
def test_a_refused_recipe_field_is_a_config_error_with_its_reason(field):
    with pytest.raises(ConfigError, match=rf"^{field}=.*not supported by raygym \(.+\)"):
        Recipe(**{field: REFUSED_VALUES[field]})
    with pytest.raises(ConfigError, match=field):
        load_train_config(["--preset", "tiny", "--" + field.replace("_", "-"), str(REFUSED_VALUES[field])])
    assert Recipe(**{field: Recipe.model_fields[field].default})  # the default is accepted


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_MODEL_FIELDS))
def test_a_refused_model_field_is_a_config_error_with_its_reason(field):
    with pytest.raises(ConfigError, match=rf"^{field}=.*not supported by raygym \(.+\)"):
        ModelConfig(hf_checkpoint="m", **{field: REFUSED_VALUES[field]})


def test_views_are_frozen_dataclasses_of_recipe_fields_without_defaults():
    names = {v.__name__ for v in VIEWS}
    assert {"TrainerSettings", "MegatronOptions", "RolloutSettings", "RLLossConfig", "JudgeSettings"} <= names
    for view in VIEWS:
        assert view_problems(view, view_extras(view)) == [], view
        recipe_fields = [f.name for f in dataclasses.fields(view) if f.name not in view_extras(view)]
        assert set(recipe_fields) <= set(Recipe.model_fields), view


def test_view_problems_catch_defaults_unknown_fields_and_mutability():
    @dataclasses.dataclass
    class Loose:
        lr: float = 1e-6
        not_a_field: int = 0

    problems = " ".join(view_problems(Loose))
    assert "not frozen" in problems and "Loose.lr: has a default" in problems
    assert "Loose.not_a_field: neither a Recipe field nor a declared extra" in problems


def test_build_view_takes_exactly_the_declared_extras():
    from raygym.rollout.manager import RolloutSettings
    from raygym.trainer.megatron_model import MegatronOptions

    with pytest.raises(TypeError, match="extras"):
        build_view(MegatronOptions, Recipe())  # params_dtype missing
    with pytest.raises(TypeError, match="extras"):
        build_view(RolloutSettings, Recipe(), seed=3)  # seed comes from the recipe
    view = build_view(RolloutSettings, Recipe(rollout_top_p=0.5))
    assert view.rollout_top_p == 0.5 and view.seed == Recipe().seed
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.rollout_top_p = 0.9  # type: ignore[misc]


# A component reading the config by name, with a default, e.g. getattr(recipe, "lr", 1e-6).
BY_NAME = re.compile(r"(?:getattr|hasattr)\((?:self\.)?\w*(?:recipe|cfg|settings|options|metrics_config|\bmc)\w*\s*,\s*[\"']")


def test_no_component_reads_the_config_by_name():
    offenders = []
    for path in sorted((ROOT / "raygym").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BY_NAME.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
