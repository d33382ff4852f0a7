"""Every validation rule raises raygym.ConfigError (a ValueError) naming the field, the value and the fix."""

from __future__ import annotations

import math
import re

import pytest

from raygym import ConfigError, DatasetConfig, MetricsConfig, ModelConfig, Recipe, TrainConfig
from raygym.config import load_callable


def reject(fragments, **kwargs):
    with pytest.raises(ConfigError) as info:
        Recipe(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_config_error_is_a_value_error_not_a_pydantic_one():
    with pytest.raises(ConfigError) as info:
        Recipe(rollout_batch_size=0)
    assert isinstance(info.value, ValueError)
    assert type(info.value).__module__ == "raygym.errors"
    assert "rollout_batch_size=0" in str(info.value) and "--rollout-batch-size" in str(info.value)


@pytest.mark.parametrize("bad", [True, 8.0, "8", None])
def test_counts_are_strict_ints(bad):
    reject(["actor_num_gpus_per_node", repr(bad)], actor_num_gpus_per_node=bad)


@pytest.mark.parametrize(
    "field",
    ["actor_num_nodes", "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "num_rollout",
     "max_tokens_per_gpu", "save_interval", "rollout_num_gpus", "update_weight_buffer_size"],
)  # fmt: skip
def test_counts_must_be_positive(field):
    reject([f"{field}=0", "must be >= 1"], **{field: 0})


def test_non_negative_counts():
    reject(["rollout_health_check_first_wait=-1", ">= 0"], rollout_health_check_first_wait=-1)
    assert Recipe(rollout_health_check_first_wait=0).rollout_health_check_first_wait == 0


def test_unknown_field_suggests_the_right_one():
    reject(["n_sample_per_prompt", "unknown field", "n_samples_per_prompt"], n_sample_per_prompt=4)


def test_sequence_parallel_needs_tensor_parallel():
    reject(["sequence_parallel", "tensor_model_parallel_size", "(got 1)"], sequence_parallel=True)
    assert Recipe(sequence_parallel=True, tensor_model_parallel_size=2).sequence_parallel


def test_model_parallel_product_divides_actor_gpus():
    reject(["tensor_model_parallel_size=3", "does not divide", "8 GPUs"], tensor_model_parallel_size=3)
    reject(["pipeline_model_parallel_size=2", "context_parallel_size=8", "= 16"], pipeline_model_parallel_size=2,
           context_parallel_size=8)  # fmt: skip


def test_expert_parallel_divides_actor_gpus():
    reject(["expert_model_parallel_size=16"], expert_model_parallel_size=16)


def test_num_experts_divisible_by_expert_parallel():
    recipe = Recipe(expert_model_parallel_size=8)
    with pytest.raises(ConfigError, match=r"num_experts=60 .*expert_model_parallel_size=8"):
        recipe.validate_model_parallelism(ModelConfig(hf_checkpoint="m", num_experts=60))
    recipe.validate_model_parallelism(ModelConfig(hf_checkpoint="m", num_experts=128))
    with pytest.raises(ConfigError, match="num_experts=60"):
        TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="m", num_experts=60))


def test_layers_divisible_by_pipeline():
    with pytest.raises(ConfigError, match=r"num_layers=30 .*pipeline_model_parallel_size=4"):
        Recipe(pipeline_model_parallel_size=4).validate_model_parallelism(
            ModelConfig(hf_checkpoint="m", num_layers=30)
        )


def test_router_topk_at_most_experts():
    with pytest.raises(ConfigError, match="moe_router_topk=9"):
        Recipe().validate_model_parallelism(ModelConfig(hf_checkpoint="m", num_experts=8, moe_router_topk=9))


def test_engine_fits_inside_one_node():
    reject(["rollout_num_gpus_per_engine=16", "one node"], rollout_num_gpus_per_engine=16)
    reject(["rollout_num_gpus_per_engine=3", "one node"], rollout_num_gpus_per_engine=3)


def test_rollout_gpus_multiple_of_engine_size():
    reject(["rollout_num_gpus=6", "multiple of rollout_num_gpus_per_engine=4"], colocate=False, rollout_num_gpus=6,
           rollout_num_gpus_per_engine=4)  # fmt: skip


def test_colocated_rollout_cannot_exceed_actor_gpus():
    reject(["rollout_num_gpus=16", "--no-colocate"], rollout_num_gpus=16)


def test_total_gpus_whole_nodes():
    reject(["not a whole number of nodes"], colocate=False, rollout_num_gpus=4)


def test_async_mode_rejects_colocate():
    reject(["async_mode=True", "colocate=True", "--no-colocate"], async_mode=True)
    assert Recipe(async_mode=True, colocate=False, rollout_num_gpus=8).async_mode


def test_delta_mode_rejects_colocate():
    reject(["update_weight_mode='delta'", "colocate=True"], update_weight_mode="delta")
    assert (
        Recipe(update_weight_mode="delta", colocate=False, rollout_num_gpus=8).update_weight_mode == "delta"
    )


def test_disk_transport_needs_a_directory():
    reject(["update_weight_disk_dir", "--update-weight-disk-dir"], update_weight_transport="disk")
    ok = Recipe(update_weight_transport="disk", update_weight_disk_dir="s3://bucket/sync")
    assert ok.update_weight_disk_dir == "s3://bucket/sync"


def test_ipc_transport_needs_colocate():
    reject(["update_weight_transport='ipc'", "colocate=True"], update_weight_transport="ipc", colocate=False,
           rollout_num_gpus=8)  # fmt: skip


@pytest.mark.parametrize(
    "field, bad",
    [("advantage_estimator", "grpoo"), ("kl_loss_type", "k4"), ("lr_decay_style", "exp"), ("optimizer", "lion"),
     ("recompute_granularity", "half"), ("recompute_method", "random"), ("update_weight_mode", "sparse"),
     ("update_weight_transport", "rdma"), ("update_weight_encoding", "xor"), ("update_weight_pause_mode", "wait"),
     ("trainer_backend", "jax"), ("rollout_engine", "tgi"), ("substep_timing", "on"), ("qkv_format", "sbhd"),
     ("megatron_to_hf_mode", "auto")],
)  # fmt: skip
def test_enums_are_checked(field, bad):
    message = reject([f"{field}={bad!r}", "must be one of"], **{field: bad})
    assert repr(Recipe.model_fields[field].default) in message


def test_ppo_needs_a_critic():
    reject(["advantage_estimator='ppo'", "use_critic", "--use-critic"], advantage_estimator="ppo")
    recipe = Recipe(advantage_estimator="ppo", use_critic=True)
    assert recipe.gpu_allocation().critic_gpus == 8 and recipe.total_nodes() == 2


def test_global_batch_divides_samples_per_step():
    reject(["global_batch_size=24", "16 x 8 = 128"], global_batch_size=24)


def test_global_batch_divisible_by_data_parallel_size():
    reject(["global_batch_size=4", "data-parallel size 8"], global_batch_size=4)
    assert Recipe(global_batch_size=4, tensor_model_parallel_size=2).data_parallel_size() == 4


def test_micro_batch_divides_per_rank_batch_without_dynamic_batching():
    reject(["micro_batch_size=3"], use_dynamic_batch_size=False, micro_batch_size=3, global_batch_size=16)
    assert Recipe(use_dynamic_batch_size=False, micro_batch_size=2).micro_batch_size == 2


def test_over_sampling_at_least_rollout_batch():
    reject(["over_sampling_batch_size=8", "rollout_batch_size=16"], over_sampling_batch_size=8)


def test_eval_interval_none_or_positive():
    assert Recipe(eval_interval=None).eval_interval is None
    reject(["eval_interval=0"], eval_interval=0)


@pytest.mark.parametrize(
    "field, bad",
    [("rollout_top_p", 0.0), ("rollout_top_p", 1.5), ("eval_top_p", -0.1), ("sglang_mem_fraction_static", 1.0),
     ("attention_dropout", 1.0), ("hidden_dropout", -0.5), ("adam_beta1", 1.0), ("adam_beta2", -0.1),
     ("eps_clip", 0.0), ("eps_clip_high", -0.1), ("eps_clip_c", 1.0), ("lr", -1e-6), ("weight_decay", -0.1),
     ("rollout_temperature", -1.0), ("gamma", 1.1), ("lambd", -0.1), ("tis_clip", 0.0), ("lr", math.nan),
     ("tis_clip_low", -0.5),
     ("colocate_engine_gpu_share", 0.0), ("update_weight_timeout", 0.0)],
)  # fmt: skip
def test_probabilities_and_rates_in_range(field, bad):
    reject([f"{field}=", "must lie in"], **{field: bad})


def test_tis_band_is_not_empty_and_its_choices_are_named():
    reject(["tis_clip_low=2.0", "tis_clip=2.0", "--tis-clip-low"], tis_clip_low=2.0)
    reject(["tis_clip_low=0.5", "tis_clip=0.4"], tis_clip_low=0.5, tis_clip=0.4)
    reject(["tis_mode='clip'", "'truncate', 'mask'"], tis_mode="clip")
    reject(["tis_level='seq'", "'token', 'sequence', 'geometric'"], tis_level="seq")
    icepop = Recipe(use_tis=True, tis_mode="mask", tis_level="token", tis_clip_low=0.5, tis_clip=2.0)
    assert (icepop.tis_mode, icepop.tis_clip_low) == ("mask", 0.5)
    # set without use_tis: unused, like the other fields of a feature that is off
    assert Recipe(tis_mode="mask", tis_level="geometric", tis_clip_low=0.99, tis_clip=1.01).use_tis is False


def test_min_lr_at_most_lr():
    reject(["min_lr=1e-05"], min_lr=1e-5)


def test_colocated_gpu_shares_fit_one_gpu():
    reject(["exceed one GPU"], colocate_trainer_gpu_share=0.7, colocate_engine_gpu_share=0.4)


def test_custom_function_fields_take_callables_or_import_paths():
    recipe = Recipe(custom_rm_function=math.sqrt, rollout_function="raygym.builtin:next_digit_reward")
    assert recipe.custom_rm_function is math.sqrt
    reject(["custom_rm_function='not a path'", "pkg.module:function"], custom_rm_function="not a path")
    reject(["dynamic_sampling_filter_path='justaname'"], dynamic_sampling_filter_path="justaname")
    reject(["custom_generate_function=42"], custom_generate_function=42)


def test_load_callable_imports_or_names_the_field():
    from raygym.builtin import next_digit_reward

    assert load_callable("raygym.builtin:next_digit_reward", "custom_rm_function") is next_digit_reward
    assert load_callable("raygym.builtin.next_digit_reward", "custom_rm_function") is next_digit_reward
    with pytest.raises(ConfigError, match=r"custom_rm_function='raygym.nope:f': cannot import"):
        load_callable("raygym.nope:f", "custom_rm_function")
    with pytest.raises(ConfigError, match="rollout_function='raygym.builtin:TINY_MODEL': names a str"):
        load_callable("raygym.builtin:TINY_MODEL", "rollout_function")


def test_extra_config_overrides_recipe_fields():
    recipe = Recipe(lr=1e-6, extra_config={"lr": 2e-6, "num_rollout": 7})
    assert (recipe.lr, recipe.num_rollout) == (2e-6, 7)
    reject(["extra_config['lrr']", "did you mean lr"], extra_config={"lrr": 1.0})
    reject(["rollout_batch_size=0"], extra_config={"rollout_batch_size": 0})


def test_json_string_fields():
    assert Recipe(train_env_vars='{"A": "1"}').train_env_vars == {"A": "1"}
    reject(["train_env_vars=", "not valid JSON"], train_env_vars="{nope")
    reject(["apply_chat_template_kwargs=", "JSON object"], apply_chat_template_kwargs="[1]")


def test_secrets_are_refused_in_environments():
    reject(["environment['WANDB_API_KEY']", "export WANDB_API_KEY"], environment={"WANDB_API_KEY": "x"})
    reject(["train_env_vars['HF_TOKEN']"], train_env_vars={"HF_TOKEN": "x"})


def test_model_dataset_metrics_rules():
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        ModelConfig(hf_checkpoint="m", dtype="fp8")
    with pytest.raises(ConfigError, match="hf_checkpoint=''"):
        ModelConfig(hf_checkpoint=" ")
    with pytest.raises(ConfigError, match="num_experts=0"):
        ModelConfig(hf_checkpoint="m", num_experts=0)
    with pytest.raises(ConfigError, match="format='csv'"):
        DatasetConfig(format="csv")
    with pytest.raises(ConfigError, match="label_key='q' equals input_key"):
        DatasetConfig(input_key="q", label_key="q")
    with pytest.raises(ConfigError, match="wandb_mode='cloud'"):
        MetricsConfig(wandb_mode="cloud")
    with pytest.raises(ConfigError, match="run_id='a b'"):
        TrainConfig(model=ModelConfig(hf_checkpoint="m"), run_id="a b")


def test_nested_dict_errors_are_config_errors_too():
    with pytest.raises(ConfigError, match="sequence_parallel"):
        TrainConfig(recipe={"sequence_parallel": True}, model={"hf_checkpoint": "m"})
    with pytest.raises(ConfigError, match=r"lr='x': Input should be a valid number"):
        TrainConfig.model_validate({"recipe": {"lr": "x"}, "model": {"hf_checkpoint": "m"}})


def test_replace_validates():
    assert Recipe().replace(num_rollout=3).num_rollout == 3
    with pytest.raises(ConfigError):
        Recipe().replace(num_rollout=0)


@pytest.mark.parametrize("fields, needle", [
    ({"rollout_env": "raygym.envs.calculator:CalculatorEnv", "custom_generate_function": "json:dumps"},
     "both set"),
    ({"rm_type": "env"}, "set rollout_env"),
    ({"rm_type": "judge"}, "judge_hf_checkpoint"),
    ({"judge_hf_checkpoint": "m", "judge_score_min": 5.0, "judge_score_max": 5.0}, "below judge_score_max"),
    ({"judge_hf_checkpoint": "m", "judge_num_gpus_per_engine": 3}, "fit in one node"),
    ({"judge_hf_checkpoint": "m", "judge_prompt_template": "no response here {prompt}"}, "{response}"),
    ({"judge_hf_checkpoint": "m", "judge_prompt_template": "{response} {oops}"}, "{response}"),
    ({"distill_kl_coef": -1.0}, "distill_kl_coef"),
    ({"rollout_env_max_turns": 0}, "rollout_env_max_turns"),
])
def test_environment_judge_and_distillation_fields(fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Recipe(**fields)


def test_auxiliary_gpus_count_judge_and_teacher():
    assert Recipe().auxiliary_gpus() == 0
    assert Recipe(judge_hf_checkpoint="m", judge_num_engines=2, judge_num_gpus_per_engine=2,
                  distill_teacher_checkpoint="t", distill_num_gpus=3).auxiliary_gpus() == 7
