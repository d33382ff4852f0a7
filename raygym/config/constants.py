"""Names and value sets of the Recipe's fields (pure, importable by the models and their checks)."""

from __future__ import annotations

from typing import Any

RECIPE_CHOICES: dict[str, tuple[Any, ...]] = {
    "trainer_backend": ("auto", "torch", "megatron"),
    "rollout_engine": ("auto", "sglang", "vllm", "raygym"),
    "advantage_estimator": ("grpo", "dr_grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "tis_mode": ("truncate", "mask"),
    "tis_level": ("token", "sequence", "geometric"),
    "substep_timing": ("auto", "off"),
    "lr_decay_style": ("constant", "linear", "cosine"),
    "optimizer": ("adam", "sgd"),
    "recompute_granularity": ("full", "selective"),
    "recompute_method": ("uniform", "block"),
    "qkv_format": ("thd", "bshd"),
    "megatron_to_hf_mode": ("", "bridge", "raw"),
    "update_weight_mode": ("full", "delta", "auto"),
    "update_weight_transport": ("nccl", "disk", "ipc"),
    "update_weight_encoding": ("indices", "deltas", "deltas_zstd"),
    "update_weight_pause_mode": ("abort", "in_place"),
    "stale_sample_policy": ("regenerate", "drop"),
    "cpu_placement": ("disjoint", "shared"),
}

# The built-in rewards (``rm_type``); raygym.rewards.scoring.BUILTIN_REWARDS holds them under these names.
RM_TYPES = ("math", "math_verify", "gsm8k", "exact", "next_digit", "long_tail", "count_shapes", "reasoning_gym")
# rm_type values the rollout task scores itself (raygym.rollout.tasks): the judge engine group, the episode's reward.
TASK_RM_TYPES = ("judge", "env")

# Counts that must be >= 1 (None allowed where the field is optional).
RECIPE_POSITIVE = (
    "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "rollout_num_gpus_per_engine",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "critic_num_nodes", "critic_num_gpus_per_node", "n_samples_per_prompt",
    "num_rollout", "rollout_batch_size", "rollout_max_response_len", "rollout_max_prompt_len",
    "over_sampling_batch_size", "trace_sample_limit", "rollout_health_check_interval",
    "rollout_health_check_timeout", "global_batch_size", "micro_batch_size", "lr_decay_iters",
    "recompute_num_layers", "max_tokens_per_gpu", "eval_interval", "n_samples_per_eval_prompt",
    "eval_max_response_len", "save_interval", "update_weight_buffer_size", "sglang_dp_size",
    "sglang_ep_size", "sglang_max_running_requests",
    "rollout_env_max_turns", "rollout_env_max_context_len", "judge_num_engines", "judge_num_gpus_per_engine",
    "judge_max_response_len", "judge_batch_size", "distill_num_gpus", "distributed_timeout_minutes",
)  # fmt: skip
RECIPE_NON_NEGATIVE = (
    "start_rollout_id", "rollout_health_check_first_wait", "lr_warmup_iters", "update_weight_full_interval", "seed",
    "judge_cache_size", "max_staleness",
)  # fmt: skip

# Fields the reference pages define that raygym does not run: a value other than the default (or an empty
# one) is refused when the config is built, with the reason.
UNSUPPORTED_RECIPE_FIELDS: dict[str, str] = {
    "megatron_to_hf_mode": "raygym checkpoints always carry an HF export (iter_N/hf) written from the trainer's "
    "HF-named weights; there is no Megatron-format checkpoint to convert",
    "slime_model_script": "the Megatron backend builds the model from the checkpoint's config.json (Qwen3 and "
    "Qwen3-MoE); no MODEL_ARGS script is read",
    "source_hf_checkpoint": "the trainers, the rollout engines and the HF export all start from model.hf_checkpoint; "
    "set --hf-checkpoint to that checkpoint instead",
    "megatron_conversion_hf_checkpoint": "the Megatron backend loads model.hf_checkpoint's weights directly, with no "
    "separate HF-to-Megatron conversion; set --hf-checkpoint to that checkpoint instead",
}
UNSUPPORTED_MODEL_FIELDS: dict[str, str] = {
    "tokenizer": "the rollout engines, the rollout manager and the HF export all read the tokenizer files of "
    "hf_checkpoint; put the tokenizer into the checkpoint directory instead",
    "trust_remote_code": "raygym builds models from the classes transformers ships and never runs code that comes "
    "with a checkpoint; use a checkpoint whose architecture transformers supports",
}

CUSTOM_FUNCTION_FIELDS = (
    "custom_rm_function",
    "custom_generate_function",
    "custom_reward_post_process_function",
    "custom_rollout_log_function",
    "custom_eval_rollout_log_function",
    "rollout_function",
    "custom_megatron_before_log_prob_hook",
    "custom_megatron_before_train_step_hook",
    "rollout_env",
)
