"""The rules of a valid :class:`raygym.config.recipe.Recipe` and what its settings imply for the trainer
backend, over the fields it declares (:class:`raygym.config.recipe_fields.RecipeFields`). Pure; ``Recipe``
runs :func:`validate_recipe` when it is built."""

from __future__ import annotations

import math
import warnings
from typing import Protocol

from raygym.callables import IMPORT_PATH
from raygym.config.base import (
    check_choice,
    check_import_path,
    check_int,
    check_no_secrets,
    check_range,
    check_unsupported,
    parse_json_object,
)
from raygym.config.constants import (
    CUSTOM_FUNCTION_FIELDS,
    RECIPE_CHOICES,
    RECIPE_NON_NEGATIVE,
    RECIPE_POSITIVE,
    RM_TYPES,
    TASK_RM_TYPES,
    UNSUPPORTED_RECIPE_FIELDS,
)
from raygym.config.recipe_fields import OPTIONAL_FIELDS, RecipeFields
from raygym.config.sections import ModelConfig
from raygym.engine_api.kinds import check_inflight_update, check_routing_replay, check_weight_sync
from raygym.engine_api.kinds import check_lora as check_lora_engine
from raygym.envs.specs import parse_env_spec
from raygym.errors import ConfigError
from raygym.vision.keys import parse_multimodal_keys


def validate_recipe(r: RecipeFields) -> None:
    """Every rule a Recipe must satisfy (run by its validator); ConfigError names field, value and fix."""
    for field, choices in RECIPE_CHOICES.items():
        check_choice(field, getattr(r, field), choices)
    check_unsupported(r.field_values(), UNSUPPORTED_RECIPE_FIELDS)
    for field in RECIPE_POSITIVE:
        check_int(field, getattr(r, field), 1, optional=field in OPTIONAL_FIELDS)
    for field in RECIPE_NON_NEGATIVE:
        check_int(field, getattr(r, field), 0, optional=True)
    check_ranges(r)
    check_parallelism(r)
    check_modes(r)
    check_batches(r)
    check_judge_and_teacher(r)
    check_lora(r)
    for field in CUSTOM_FUNCTION_FIELDS:
        value = getattr(r, field)
        if value is not None and not isinstance(value, str) and not callable(value):
            raise ConfigError(f"{field}={value!r}: must be a callable or 'pkg.module:function'")
        if field == "rollout_env" and parse_env_spec(value) is not None:
            continue  # verifiers:... / openenv:... (raygym/envs/specs.py checked its form)
        check_import_path(field, value)
    check_import_path("dynamic_sampling_filter_path", r.dynamic_sampling_filter_path)
    if r.rm_type is not None and r.rm_type not in RM_TYPES + TASK_RM_TYPES:
        raise ConfigError(
            f"rm_type={r.rm_type!r}: unknown built-in reward; pass --rm-type with one of "
            f"{', '.join(map(repr, RM_TYPES + TASK_RM_TYPES))}, or --custom-rm-function pkg.module:function"
        )
    for key, weight in (r.reward_functions or {}).items():
        if key not in RM_TYPES and (not IMPORT_PATH.match(key) or ("." not in key and ":" not in key)):
            raise ConfigError(
                f"reward_functions key {key!r}: neither a built-in reward ({', '.join(RM_TYPES)}) nor an "
                "import path; write it as 'pkg.module:function'"
            )
        if not math.isfinite(weight):
            raise ConfigError(f"reward_functions[{key!r}]={weight!r}: a weight must be a finite number")
    if r.rollout_stop_token_ids and min(r.rollout_stop_token_ids) < 0:
        raise ConfigError(f"rollout_stop_token_ids={r.rollout_stop_token_ids!r}: token ids are >= 0")
    check_no_secrets("environment", r.environment)
    check_no_secrets("train_env_vars", r.train_env_vars)
    if isinstance(r.apply_chat_template_kwargs, str) and r.apply_chat_template_kwargs:
        parse_json_object("apply_chat_template_kwargs", r.apply_chat_template_kwargs)
    parse_multimodal_keys(r.multimodal_keys)  # a map of "image" to a column, or nothing


def check_ranges(r: RecipeFields) -> None:
    check_range("lr", r.lr, 0.0, math.inf)
    check_range("min_lr", r.min_lr, 0.0, r.lr)
    check_range("critic_lr", r.critic_lr, 0.0, math.inf)
    check_range("value_clip", r.value_clip, 0.0, math.inf)
    check_range("weight_decay", r.weight_decay, 0.0, math.inf)
    check_range("adam_beta1", r.adam_beta1, 0.0, 1.0, high_open=True)
    check_range("adam_beta2", r.adam_beta2, 0.0, 1.0, high_open=True)
    check_range("eps_clip", r.eps_clip, 0.0, 1.0, low_open=True)
    check_range("eps_clip_high", r.eps_clip_high, 0.0, math.inf, low_open=True)
    check_range("eps_clip_c", r.eps_clip_c, 1.0, math.inf, low_open=True)
    check_range("tis_clip", r.tis_clip, 0.0, math.inf, low_open=True)
    check_range("tis_clip_low", r.tis_clip_low, 0.0, math.inf)
    if r.tis_clip_low >= r.tis_clip:
        raise ConfigError(
            f"tis_clip_low={r.tis_clip_low!r} is not below tis_clip={r.tis_clip!r}: the importance weight's "
            "band [tis_clip_low, tis_clip] would be empty; lower --tis-clip-low or raise --tis-clip"
        )
    check_range("update_weight_probe_tolerance", r.update_weight_probe_tolerance, 0.0, math.inf, low_open=True)
    for field in ("kl_loss_coef", "kl_coef", "entropy_coef", "clip_grad", "rollout_temperature"):
        check_range(field, getattr(r, field), 0.0, math.inf)
    for field in ("rollout_top_p", "eval_top_p"):
        check_range(field, getattr(r, field), 0.0, 1.0, low_open=True)
    for field in ("attention_dropout", "hidden_dropout"):
        check_range(field, getattr(r, field), 0.0, 1.0, high_open=True)
    for field in ("gamma", "lambd"):
        check_range(field, getattr(r, field), 0.0, 1.0)
    check_range(
        "sglang_mem_fraction_static",
        r.sglang_mem_fraction_static,
        0.0,
        1.0,
        low_open=True,
        high_open=True,
    )
    for field in ("colocate_trainer_gpu_share", "colocate_engine_gpu_share"):
        check_range(field, getattr(r, field), 0.0, 1.0, low_open=True)
    for field in ("placement_timeout", "update_weight_timeout"):
        check_range(field, getattr(r, field), 0.0, math.inf, low_open=True)
    if r.colocate and r.colocate_trainer_gpu_share + r.colocate_engine_gpu_share > 1.0 + 1e-9:
        raise ConfigError(
            f"colocate_trainer_gpu_share={r.colocate_trainer_gpu_share} + colocate_engine_gpu_share="
            f"{r.colocate_engine_gpu_share} exceed one GPU; lower them so they sum to at most 1.0"
        )


def check_parallelism(r: RecipeFields) -> None:
    tp, pp, cp = (
        r.tensor_model_parallel_size,
        r.pipeline_model_parallel_size,
        r.context_parallel_size,
    )
    if r.sequence_parallel and tp <= 1:
        raise ConfigError(
            f"sequence_parallel=True needs tensor_model_parallel_size > 1 (got {tp}); "
            "set --tensor-model-parallel-size 2 or more, or pass --no-sequence-parallel"
        )
    actor_gpus = r.actor_num_nodes * r.actor_num_gpus_per_node
    if actor_gpus % (tp * pp * cp):
        raise ConfigError(
            f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x context_parallel_size={cp}"
            f" = {tp * pp * cp} does not divide the actor's {actor_gpus} GPUs "
            "(actor_num_nodes x actor_num_gpus_per_node); pick sizes whose product divides it"
        )
    ep = r.expert_model_parallel_size
    if actor_gpus % (ep * pp):
        raise ConfigError(
            f"expert_model_parallel_size={ep} x pipeline_model_parallel_size={pp} does not divide the actor's "
            f"{actor_gpus} GPUs; pick an expert-parallel size that divides {actor_gpus // pp}"
        )
    if r.actor_num_gpus_per_node % r.rollout_num_gpus_per_engine:
        raise ConfigError(
            f"rollout_num_gpus_per_engine={r.rollout_num_gpus_per_engine}: an engine must fit inside one "
            f"node of actor_num_gpus_per_node={r.actor_num_gpus_per_node} GPUs; pick a divisor of it"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r.gpu_allocation()


def check_modes(r: RecipeFields) -> None:
    if r.async_mode and r.colocate:
        raise ConfigError(
            "async_mode=True cannot run with colocate=True: rollout and training overlap and need their "
            "own GPUs; pass --no-colocate (and --rollout-num-gpus) or --no-async-mode"
        )
    check_fully_async(r)
    check_split(r)
    if r.update_weight_mode == "delta" and r.colocate:
        raise ConfigError(
            "update_weight_mode='delta' with colocate=True: colocated engines receive weights by handle, a "
            "delta saves nothing; use --update-weight-mode full or pass --no-colocate"
        )
    if r.update_weight_transport == "disk" and not r.update_weight_disk_dir:
        raise ConfigError(
            "update_weight_transport='disk' needs update_weight_disk_dir: set --update-weight-disk-dir to a "
            "directory (or fsspec URL) that trainers and engines share"
        )
    if r.update_weight_transport == "ipc" and not r.colocate:
        raise ConfigError(
            "update_weight_transport='ipc' needs colocate=True (handles only work on the same GPU); "
            "use --update-weight-transport nccl or pass --colocate"
        )
    if r.update_weight_double_buffer and r.colocate:
        raise ConfigError(
            "update_weight_double_buffer=True with colocate=True: colocated engines release their memory for "
            "training and receive weights by handle, there is nothing to serve from during a sync; pass "
            "--no-update-weight-double-buffer or --no-colocate"
        )
    if r.rollout_engine != "auto":
        check_weight_sync(r.rollout_engine, mode=r.update_weight_mode, transport=r.update_weight_transport,
                          colocate=r.colocate, double_buffer=r.update_weight_double_buffer)
        if r.use_rollout_routing_replay:  # whether it runs on CUDA: raygym.run.graph.preflight_engine
            check_routing_replay(r.rollout_engine)
    if r.advantage_estimator == "ppo" and not r.use_critic:
        raise ConfigError(
            "advantage_estimator='ppo' needs use_critic=True (PPO learns a value function); pass --use-critic"
        )


def check_batches(r: RecipeFields) -> None:
    per_step = r.rollout_batch_size * r.n_samples_per_prompt
    if per_step % r.global_batch_size:
        raise ConfigError(
            f"global_batch_size={r.global_batch_size} does not divide rollout_batch_size x "
            f"n_samples_per_prompt = {r.rollout_batch_size} x {r.n_samples_per_prompt} = {per_step}; "
            f"pick a divisor of {per_step}"
        )
    dp = r.data_parallel_size()
    if r.global_batch_size % dp:
        raise ConfigError(
            f"global_batch_size={r.global_batch_size} is not divisible by the data-parallel size {dp} "
            "(actor GPUs / (tensor x pipeline x context parallel)); pick a multiple of it"
        )
    if not r.use_dynamic_batch_size and (r.global_batch_size // dp) % r.micro_batch_size:
        raise ConfigError(
            f"micro_batch_size={r.micro_batch_size} does not divide the {r.global_batch_size // dp} "
            "samples per data-parallel rank and step; pick a divisor, or --use-dynamic-batch-size"
        )
    if (
        r.over_sampling_batch_size is not None
        and r.over_sampling_batch_size < r.rollout_batch_size
    ):
        raise ConfigError(
            f"over_sampling_batch_size={r.over_sampling_batch_size} is smaller than rollout_batch_size="
            f"{r.rollout_batch_size}; set it to at least {r.rollout_batch_size} or leave it unset"
        )


def check_judge_and_teacher(r: RecipeFields) -> None:
    """The environment's, the judge's and the teacher's fields (raygym/envs, judge.py, distill.py)."""
    if r.rollout_env is not None and r.custom_generate_function is not None:
        raise ConfigError(
            "rollout_env and custom_generate_function are both set: an environment run generates its "
            "episodes itself; keep one of them"
        )
    if r.rm_type == "env" and r.rollout_env is None:
        raise ConfigError("rm_type='env' rewards environment episodes: set rollout_env too, or another rm_type")
    if r.rm_type == "judge" and not r.judge_hf_checkpoint:
        raise ConfigError("rm_type='judge' needs judge_hf_checkpoint: set --judge-hf-checkpoint to the judge model")
    if not r.judge_score_max > r.judge_score_min:
        raise ConfigError(
            f"judge_score_min={r.judge_score_min} must be below judge_score_max={r.judge_score_max}; "
            "set them to the score range judge_prompt_template asks for"
        )
    if r.judge_hf_checkpoint:
        if r.actor_num_gpus_per_node % r.judge_num_gpus_per_engine:
            raise ConfigError(
                f"judge_num_gpus_per_engine={r.judge_num_gpus_per_engine}: a judge engine must fit in one "
                f"node of actor_num_gpus_per_node={r.actor_num_gpus_per_node} GPUs; pick a divisor of it"
            )
        import string as _string

        try:
            names = {n for _, n, _, _ in _string.Formatter().parse(r.judge_prompt_template) if n is not None}
        except ValueError as exc:
            raise ConfigError(
                f"judge_prompt_template={r.judge_prompt_template!r}: not a format string ({exc})"
            ) from None
        if "response" not in names or not names <= {"prompt", "response", "label"}:
            raise ConfigError(
                f"judge_prompt_template={r.judge_prompt_template!r}: use {{response}} (and optionally "
                "{prompt}, {label}) and write literal braces as {{ }}"
            )
    check_range("distill_kl_coef", r.distill_kl_coef, 0.0, math.inf)
    check_range("distill_task_weight", r.distill_task_weight, 0.0, math.inf)


def check_lora(r: RecipeFields) -> None:
    """The ``lora_*`` fields (:mod:`raygym.lora`): a rank of 0 turns LoRA off, so the other fields must then keep
    their defaults (a value there would be silently ignored); the targets' syntax (checked against the model
    before Ray starts, by :func:`raygym.run.graph.preflight_engine`)."""
    from raygym.lora import parse_target_modules

    if r.lora_rank < 0:
        raise ConfigError(f"lora_rank={r.lora_rank}: must be >= 0; set --lora-rank 8 (or 16, 32, ...) to train "
                          "adapters, or 0 for full fine-tuning")
    if r.lora_rank == 0:
        defaults = {name: type(r).model_fields[name].default for name in LORA_SETTINGS}
        changed = [f"{name}={getattr(r, name)!r}" for name in LORA_SETTINGS if getattr(r, name) != defaults[name]]
        if changed:
            raise ConfigError(f"{', '.join(changed)} but lora_rank=0 (LoRA off): set --lora-rank 8 (or 16, 32, ...) "
                              "to train adapters, or leave the lora_* fields at their defaults")
        return
    if r.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha={r.lora_alpha}: must be > 0 (the update is scaled by lora_alpha / lora_rank), "
                          "e.g. --lora-alpha 16")
    check_range("lora_dropout", r.lora_dropout, 0.0, 1.0, high_open=True)
    parse_target_modules(r.lora_target_modules)
    requests = model_parallel_requests(r)
    if r.trainer_backend == "megatron" or requests:
        why = f"trainer_backend={r.trainer_backend!r}" + (f" with {', '.join(requests)}" if requests else "")
        raise ConfigError(
            f"lora_rank={r.lora_rank} with {why}: LoRA trains on the torch backend only (megatron-core ships no "
            "LoRA); set --trainer-backend torch (data parallel: tensor_model_parallel_size=1, "
            "expert_model_parallel_size=1, no sequence_parallel), or --lora-rank 0 for full fine-tuning on Megatron"
        )
    if r.freeze_params_name_list:
        raise ConfigError("freeze_params_name_list with lora_rank > 0: LoRA already freezes every base weight and "
                          "trains the adapters only; drop --freeze-params-name-list or set --lora-rank 0")
    if r.rollout_engine != "auto":
        check_lora_engine(r.rollout_engine, mode=r.update_weight_mode, double_buffer=r.update_weight_double_buffer)
    if r.use_critic:
        raise ConfigError("use_critic=True with lora_rank > 0: the PPO critic is a full model of its own; raygym "
                          "trains LoRA for the policy of critic-free estimators (grpo, dr_grpo, gspo, reinforce++); "
                          "set --lora-rank 0 or use one of those")


LORA_SETTINGS = ("lora_alpha", "lora_dropout", "lora_target_modules")


class ParallelLayout(Protocol):
    """What the trainer backend choice depends on: a Recipe, or the trainer's view of one
    (``raygym.trainer.backend.TrainerSettings``)."""

    @property
    def trainer_backend(self) -> str: ...
    @property
    def tensor_model_parallel_size(self) -> int: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def pipeline_model_parallel_size(self) -> int: ...
    @property
    def context_parallel_size(self) -> int: ...
    @property
    def expert_model_parallel_size(self) -> int: ...
    @property
    def lora_rank(self) -> int: ...


def model_parallel_requests(r: ParallelLayout) -> list[str]:
    """``field=value`` of every model-parallel setting this recipe asks for (sizes > 1,
    ``sequence_parallel``): only the Megatron trainer backend runs them.
    """
    sizes = {
        "tensor_model_parallel_size": r.tensor_model_parallel_size,
        "pipeline_model_parallel_size": r.pipeline_model_parallel_size,
        "context_parallel_size": r.context_parallel_size,
        "expert_model_parallel_size": r.expert_model_parallel_size,
    }
    requests = [f"{name}={value}" for name, value in sizes.items() if value > 1]
    if r.sequence_parallel:
        requests.insert(1 if r.tensor_model_parallel_size > 1 else 0, "sequence_parallel=True")
    return requests


def check_trainer_backend(r: ParallelLayout, *, megatron_installed: bool | None = None) -> str | None:
    """ConfigError when no trainer backend can run this recipe; otherwise the backend it will run on
    (``None``: ``trainer_backend="auto"`` without model parallelism, decided on the trainer's machine).

    Pipeline and context parallelism are not run by any backend. Tensor, sequence and expert
    parallelism need the Megatron backend: with ``trainer_backend="torch"`` they are refused, with
    ``"auto"`` they select Megatron. ``megatron_installed`` (None = not checked): whether megatron-core
    imports where the trainers run.
    """
    for name, value in (("pipeline_model_parallel_size", r.pipeline_model_parallel_size),
                        ("context_parallel_size", r.context_parallel_size)):
        if value > 1:
            raise ConfigError(
                f"{name}={value}: no raygym trainer backend runs it yet (the Megatron backend has no pipeline "
                f"or context-parallel schedule); set {name}=1 and use tensor_model_parallel_size / "
                "expert_model_parallel_size (or more data-parallel GPUs) instead"
            )
    requests = model_parallel_requests(r)
    if r.lora_rank > 0:  # check_lora refused Megatron and model parallelism already
        return "torch"
    if r.trainer_backend == "torch" and requests:
        raise ConfigError(
            f"trainer_backend='torch' with {', '.join(requests)}: the torch backend is data parallel (FSDP2) "
            "only; set trainer_backend='megatron' (pip install 'raygym[megatron]') or set "
            "tensor_model_parallel_size=1, expert_model_parallel_size=1 and sequence_parallel=False"
        )
    needs_megatron = r.trainer_backend == "megatron" or bool(requests)
    if needs_megatron and megatron_installed is False:
        why = f"trainer_backend={r.trainer_backend!r}" + (f" with {', '.join(requests)}" if requests else "")
        raise ConfigError(
            f"{why}: needs the Megatron backend, and megatron-core is not installed here; "
            "pip install 'raygym[megatron]'"
            + (", or set tensor_model_parallel_size=1, expert_model_parallel_size=1 and sequence_parallel=False "
               "to train with torch" if requests else ", or set trainer_backend='torch'")
        )
    if needs_megatron:
        return "megatron"
    return "torch" if r.trainer_backend == "torch" else None


def trainer_backend_summary(r: RecipeFields, *, megatron_installed: bool) -> str:
    """One line for ``raygym plan``: the trainer backend this recipe runs on and why.
    """
    resolved = check_trainer_backend(r)
    requests = model_parallel_requests(r)
    if resolved is None:
        text = "trainer backend: auto (megatron on a CUDA machine with megatron-core, else torch)"
    elif requests and r.trainer_backend == "auto":
        text = f"trainer backend: megatron ({', '.join(requests)} needs it)"
    else:
        text = f"trainer backend: {resolved}"
    if resolved == "megatron" and not megatron_installed:
        text += "; megatron-core is not installed here (pip install 'raygym[megatron]' where the trainers run)"
    return text


def validate_model_parallelism(r: RecipeFields, model: ModelConfig) -> None:
    """Check the parallel sizes against the model's architecture, where the architecture is known."""
    ep, pp = r.expert_model_parallel_size, r.pipeline_model_parallel_size
    if model.num_experts is not None and model.num_experts % ep:
        raise ConfigError(
            f"num_experts={model.num_experts} is not divisible by expert_model_parallel_size={ep}; "
            "pick an expert-parallel size that divides the number of experts"
        )
    if (
        model.num_experts is not None
        and model.moe_router_topk is not None
        and model.moe_router_topk > model.num_experts
    ):
        raise ConfigError(
            f"moe_router_topk={model.moe_router_topk} exceeds num_experts={model.num_experts}; lower --moe-router-topk"
        )
    if model.num_layers is not None and model.num_layers % pp:
        raise ConfigError(
            f"num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size={pp}; "
            "pick a pipeline size that divides the layer count"
        )


def check_fully_async(r: RecipeFields) -> None:
    """``fully_async``: its own GPUs for the engines, one asynchronous mode, a whole-step rollout function
    refused (the stream generates group by group), and an engine kind that takes weight updates while requests
    are in flight (:func:`raygym.engine_api.kinds.check_inflight_update`)."""
    if not r.fully_async:
        return
    if r.async_mode:
        raise ConfigError("fully_async=True and async_mode=True: pick one asynchronous mode; --fully-async "
                          "(generation runs up to max_staleness steps ahead) or --async-mode (one step off-policy)")
    if r.colocate:
        raise ConfigError("fully_async=True cannot run with colocate=True: engines generate while the trainer trains "
                          "and need their own GPUs; pass --no-colocate (and --rollout-num-gpus) or --no-fully-async")
    if r.rollout_function is not None:
        raise ConfigError("fully_async=True with rollout_function: a rollout function replaces a whole step, the "
                          "asynchronous stream generates group by group; use custom_generate_function (per sample) "
                          "or --no-fully-async")
    if r.rollout_engine != "auto":
        check_inflight_update(r.rollout_engine, pause_mode=r.update_weight_pause_mode)


def check_split(r: RecipeFields) -> None:
    """``cpu_engine_cores`` at least one; ``auto_split`` only where engines decode while the trainer trains, with
    probe steps (one of warm-up, at least two measured) that leave steps to run after the re-pick."""
    if r.cpu_engine_cores is not None and r.cpu_engine_cores < 1:
        raise ConfigError(f"cpu_engine_cores={r.cpu_engine_cores}: the engines need at least one core; set "
                          "--cpu-engine-cores to 1 or more, or leave it unset (one core per engine)")
    if not r.auto_split:
        return
    if r.colocate or not (r.async_mode or r.fully_async):
        raise ConfigError("auto_split=True balances engines that decode while the trainer trains on devices of "
                          "their own; pass --no-colocate with --async-mode or --fully-async, or --no-auto-split")
    if r.use_critic:
        raise ConfigError("auto_split=True with use_critic=True: the critic's devices are not part of the split; "
                          "set --rollout-num-gpus yourself or pass --no-auto-split")
    if r.auto_split_probe_steps < 3 or r.auto_split_probe_steps >= r.num_rollout:
        raise ConfigError(f"auto_split_probe_steps={r.auto_split_probe_steps} with num_rollout={r.num_rollout}: "
                          "measure at least 3 steps (the first is warm-up) and fewer than the run has; set "
                          "--auto-split-probe-steps between 3 and num_rollout - 1")
