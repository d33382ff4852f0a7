"""Typed configuration: ``Recipe`` (how to train), ``ModelConfig``, ``DatasetConfig``, ``MetricsConfig``
and ``TrainConfig`` (all of it, plus where the run writes).

Field names and defaults follow the ``Qwen3_4B_Recipe`` reference page; raygym's own fields are
listed in ``docs/internals.md``. Every invalid value raises :class:`raygym.errors.ConfigError` (a
``ValueError``) naming the field, the value and the fix, before any Ray resource is requested.

Pure: imports neither torch nor ray, so validation and ``raygym plan`` run anywhere.

>>> r = Recipe(rollout_batch_size=32)
>>> r.gpu_allocation().rollout_engines, r.total_nodes(), r.data_parallel_size()
(8, 1, 8)
>>> cfg = TrainConfig(recipe=r, model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"))
>>> TrainConfig.from_cli_args(cfg.cli_args()) == cfg
True
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import json
import math
import re
import secrets
import time
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raygym.allocation import GpuAllocation, compute_allocation
from raygym.errors import ConfigError
from raygym.rollout.capabilities import check_weight_sync

__all__ = [
    "RM_TYPES",
    "ConfigError",
    "DatasetConfig",
    "GpuAllocation",
    "MetricsConfig",
    "ModelConfig",
    "Recipe",
    "TrainConfig",
    "callable_import_path",
    "load_callable",
    "new_run_id",
]

# A user function: the callable itself, or its import path "pkg.module:function" (or "pkg.module.function").
CustomFunction = Callable[..., Any] | str | None

MiB = 1024 * 1024

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")
# Environment keys that look like credentials: secrets come from the process environment, never the config.
_SECRET_KEY = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


# ── custom functions ─────────────────────────────────────────────────────────────────────────────


def load_callable(value: Callable[..., Any] | str | None, field: str) -> Callable[..., Any] | None:
    """Return ``value`` if it is callable, else import the path ``"pkg.module:function"`` (None or ""
    stays None: the field is unset).

    Raises ConfigError naming ``field`` when the path does not import or does not name a callable.

    >>> load_callable("json:dumps", "custom_rm_function")([1])
    '[1]'
    """
    if value is None or value == "":
        return None
    if callable(value):
        return value
    if not isinstance(value, str) or not _IMPORT_PATH.match(value) or ("." not in value and ":" not in value):
        raise ConfigError(
            f"{field}={value!r}: not a callable or an import path; write it as 'pkg.module:function'"
        )
    module_name, _, attr_path = value.partition(":") if ":" in value else value.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{field}={value!r}: cannot import it ({type(exc).__name__}: {exc}); check the module is on "
            "PYTHONPATH and the function name is right"
        ) from exc
    if not callable(obj):
        raise ConfigError(
            f"{field}={value!r}: names a {type(obj).__name__}, not a callable; point it at a function"
        )
    return obj


def callable_import_path(fn: Callable[..., Any] | str, field: str) -> str:
    """The import path ``"module:qualname"`` that loads ``fn`` back; strings are returned unchanged.

    Lambdas, local functions and functions of ``__main__`` have no such path: ConfigError.
    """
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname or module == "__main__":
        raise ConfigError(
            f"{field}={fn!r}: a lambda, local function or __main__ function has no import path; define it "
            "at the top level of an importable module and pass it (or 'pkg.module:function')"
        )
    path = f"{module}:{qualname}"
    try:
        same = load_callable(path, field) is fn
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"{field}={fn!r}: importing {path!r} gives a different object (decorated or shadowed); "
            "pass the import path of the function you mean"
        )
    return path


def _callable_identity(value: Any) -> Any:
    """What equality compares for a custom function: its import path when it has one."""
    if value is None or isinstance(value, str):
        return value
    try:
        return callable_import_path(value, "function")
    except ConfigError:
        return value


# ── shared model machinery ───────────────────────────────────────────────────────────────────────


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("collections.abc.", "")


def _config_error_from(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """One ConfigError for a pydantic ValidationError: our own message when a rule raised it."""
    messages: list[str] = []
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            return inner
        loc = [part for part in err["loc"] if isinstance(part, str)]
        owner: type[BaseModel] = model
        path: list[str] = []
        for part in loc:
            if part not in owner.model_fields:
                break
            path.append(part)
            annotation = owner.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                owner = annotation
            else:
                break
        name = path[-1] if path else (loc[0] if loc else model.__name__)
        dotted = ".".join(path) or name
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, list(owner.model_fields), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"see the fields of {owner.__name__}"
            messages.append(f"{dotted}: unknown field of {owner.__name__}; {hint}")
        elif err["type"] == "missing" and name == "model":
            messages.append("model: required; pass model=ModelConfig(hf_checkpoint=...) (--hf-checkpoint)")
        elif err["type"] == "missing":
            messages.append(f"{dotted}: required; set it (e.g. {_flag(name)} VALUE)")
        else:
            expected = _type_name(owner.model_fields[name].annotation) if name in owner.model_fields else "?"
            messages.append(
                f"{dotted}={err.get('input')!r}: {err['msg']} (expected {expected}); "
                f"set {_flag(name)} to a value of that type"
            )
    return ConfigError("; ".join(messages))


class _Section(BaseModel):
    """Base of the config models: strict types, no unknown fields, ConfigError on bad input."""

    model_config = ConfigDict(
        extra="forbid", strict=True, arbitrary_types_allowed=True, validate_assignment=False
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error_from(exc, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any):  # type: ignore[override]
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _config_error_from(exc, cls) from None

    def field_values(self) -> dict[str, Any]:
        """Every field's current value, by name (no copies, callables kept)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def replace(self, **changes: Any):
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return type(self)(**{**self.field_values(), **changes})


def _check_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(f"{field}={value!r}: must be one of {', '.join(repr(c) for c in choices)}")


def _check_int(field: str, value: int | None, minimum: int, *, optional: bool = False) -> None:
    if value is None:
        if optional:
            return
        raise ConfigError(f"{field}=None: must be an int >= {minimum}; set {_flag(field)}")
    if value < minimum:
        raise ConfigError(f"{field}={value!r}: must be >= {minimum}; set {_flag(field)} to {minimum} or more")


def _check_range(
    field: str,
    value: float | None,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """``value`` within [low, high] (with open ends as asked); NaN is always out of range."""
    if value is None:
        return
    ok = not math.isnan(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{field}={value!r}: must lie in {interval}; set {_flag(field)} inside that range")


def _check_no_secrets(field: str, env: Any) -> None:
    if isinstance(env, dict):
        for key in env:
            if _SECRET_KEY.search(str(key)):
                raise ConfigError(
                    f"{field}[{key!r}]: looks like a credential; configs are written to disk and passed on "
                    f"command lines, so export {key} in the environment of the driver instead"
                )


def _check_import_path(field: str, value: Any) -> None:
    if isinstance(value, str) and (not _IMPORT_PATH.match(value) or ("." not in value and ":" not in value)):
        raise ConfigError(f"{field}={value!r}: not an import path; write it as 'pkg.module:function'")


# ── Recipe ───────────────────────────────────────────────────────────────────────────────────────

_RECIPE_CHOICES: dict[str, tuple[Any, ...]] = {
    "trainer_backend": ("auto", "torch", "megatron"),
    "rollout_engine": ("auto", "sglang", "raygym"),
    "advantage_estimator": ("grpo", "dr_grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
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
}

# The built-in rewards (``rm_type``); raygym.rewards.BUILTIN_REWARDS holds them under these names.
RM_TYPES = ("math", "math_verify", "gsm8k", "exact", "next_digit")

# Counts that must be >= 1 (None allowed where the field is optional).
_RECIPE_POSITIVE = (
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
    "judge_max_response_len", "judge_batch_size", "distill_num_gpus",
)  # fmt: skip
_RECIPE_NON_NEGATIVE = (
    "start_rollout_id", "rollout_health_check_first_wait", "lr_warmup_iters", "update_weight_full_interval", "seed",
    "judge_cache_size",
)  # fmt: skip

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


def _f(default: Any, doc: str) -> Any:
    return Field(default, description=doc)


def _fd(factory: Callable[[], Any], doc: str) -> Any:
    return Field(default_factory=factory, description=doc)


class Recipe(_Section):
    """How to train: cluster shape, algorithm, rollout, optimisation, checkpoints, weight sync.

    Flat, with the ``Qwen3_4B_Recipe`` reference page's field names and defaults (so ``Recipe()``
    is the Qwen3-4B recipe: 1 node x 8 GPUs, colocated), plus raygym's own fields. ``extra_config``
    keys override the same-named fields.

    >>> Recipe(colocate=False).gpu_allocation().total_nodes
    2
    """

    # ── cluster and parallelism ──
    actor_num_nodes: int = _f(1, "Nodes for the actor (policy) trainer.")
    actor_num_gpus_per_node: int = _f(8, "GPUs per actor node (also the GPUs per node of the whole cluster).")
    colocate: bool = _f(True, "Share GPUs between the trainer and rollout engines.")
    rollout_num_gpus: int | None = _f(
        None, "Total GPUs for rollout engines when disaggregated; None lets the allocation resolver size it."
    )
    rollout_num_gpus_per_engine: int = _f(1, "GPUs and tensor-parallel size per rollout engine.")
    tensor_model_parallel_size: int = _f(1, "Megatron tensor-parallel size for the actor.")
    sequence_parallel: bool = _f(
        False, "Megatron sequence parallelism. Requires tensor parallelism greater than one."
    )
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size for the actor.")
    context_parallel_size: int = _f(1, "Context-parallel size for the actor.")
    expert_model_parallel_size: int = _f(1, "Expert-parallel size for MoE models.")
    use_critic: bool = _f(False, "Train a separate critic model for PPO. GRPO does not use one.")
    critic_num_nodes: int | None = _f(
        None, "Nodes for the critic when use_critic is set (default: the actor's)."
    )
    critic_num_gpus_per_node: int | None = _f(None, "GPUs per critic node (default: the actor's).")
    trainer_backend: str = _f(
        "auto", "Trainer implementation: 'torch' (HF model, FSDP2), 'megatron' or 'auto'."
    )
    rollout_engine: str = _f(
        "auto",
        "Rollout engine: 'sglang', 'raygym' (built-in server) or 'auto' (sglang when CUDA and sglang exist).",
    )
    colocate_trainer_gpu_share: float = _f(
        0.5, "Fraction of each GPU the trainer bundle claims when colocated."
    )
    colocate_engine_gpu_share: float = _f(0.4, "Fraction of each GPU an engine bundle claims when colocated.")
    placement_timeout: float = _f(600.0, "Seconds to wait for the placement groups before failing.")
    async_mode: bool = _f(
        False, "Overlap rollout generation and training, one step off-policy (needs colocate=False)."
    )
    environment: dict[str, str] = _fd(
        lambda: {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "1"},
        "Environment variables for every Ray worker of the run (NCCL settings and the like; no secrets).",
    )
    train_env_vars: dict[str, str] | None = _f(
        None, "Extra environment variables for the training processes only (a dict, or inline JSON)."
    )

    # ── RL algorithm ──
    advantage_estimator: str = _f("grpo", "Advantage estimator.")
    n_samples_per_prompt: int = _f(8, "Responses sampled per prompt as one GRPO group.")
    eps_clip: float = _f(0.2, "PPO clip lower bound.")
    eps_clip_high: float = _f(0.28, "Upper PPO clip bound for asymmetric DAPO clipping.")
    eps_clip_c: float | None = _f(
        None, "Dual-clip constant for negative advantages (> 1); None disables dual clip."
    )
    use_kl_loss: bool = _f(False, "Add a per-token KL loss term against the reference model.")
    kl_loss_type: str = _f("low_var_kl", "KL formulation.")
    kl_loss_coef: float = _f(0.0, "Coefficient of the KL loss term.")
    kl_coef: float = _f(0.0, "KL penalty coefficient applied in the reward.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    calculate_per_token_loss: bool = _f(False, "Average the loss over tokens instead of over samples.")
    ref_load: str = _f("", "Checkpoint read by the reference model for KL terms.")
    use_tis: bool = _f(False, "Truncated importance sampling against the rollout log-probs.")
    tis_clip: float = _f(2.0, "Upper clamp of the truncated importance-sampling weight.")
    gamma: float = _f(1.0, "Discount factor (PPO / GAE).")
    lambd: float = _f(1.0, "GAE lambda (PPO).")
    critic_lr: float | None = _f(None, "Critic learning rate; None uses lr.")

    # ── rollout ──
    num_rollout: int = _f(1, "Training and rollout steps for the run.")
    start_rollout_id: int | None = _f(
        None, "Rollout step to start counting from; None continues from the iteration stored in load."
    )
    rollout_batch_size: int = _f(
        16, "Prompts sampled per rollout step; each prompt is expanded into a group of sampled responses."
    )
    rollout_max_response_len: int = _f(4096, "Max generated tokens per sample.")
    rollout_max_prompt_len: int | None = _f(
        None, "Prompts longer than this many tokens are skipped; None keeps all."
    )
    rollout_temperature: float = _f(1.0, "Sampling temperature for rollout generation.")
    rollout_top_p: float = _f(1.0, "Nucleus-sampling top-p for rollout generation.")
    rollout_stop_token_ids: list[int] | None = _f(None, "Extra token ids that terminate generation.")
    rollout_shuffle: bool = _f(True, "Shuffle the prompt dataset between epochs.")
    over_sampling_batch_size: int | None = _f(None, "Extra DAPO prompts sampled to replace filtered groups.")
    dynamic_sampling_filter_path: str | None = _f(
        None, "Import path of the predicate that selects sample groups ('pkg.module:function')."
    )
    balance_data: bool = _f(False, "Rebalance kept samples across data-parallel ranks.")
    rm_type: str | None = _f(
        None,
        "Built-in reward (next_digit scores the builtin task; math_verify needs raygym[math]). Leave unset "
        "for a custom reward.",
    )
    reward_functions: dict[str, float] | None = _f(
        None,
        "Several rewards summed with weights, {name: weight}: built-in rm_type names or import paths "
        "('pkg.module:function'); each is logged as rollout/reward/<name>. Overrides rm_type and "
        "custom_rm_function.",
    )
    capture_trace: bool = _f(False, "Attach sampled per-request execution traces to recorded rollouts.")
    trace_sample_limit: int = _f(16, "Maximum traced samples per rollout when capture_trace is enabled.")
    substep_timing: str = _f("auto", "Per-substep timing metrics: 'auto' or 'off'.")

    # ── fault tolerance ──
    use_fault_tolerance: bool = _f(True, "Recover from rollout engine failures (health checks and restarts).")
    rollout_health_check_interval: int = _f(
        30, "Interval in seconds between rollout engine /health_generate checks during generate/eval."
    )
    rollout_health_check_timeout: int = _f(
        30, "Timeout in seconds to wait for a rollout engine /health_generate response before killing it."
    )
    rollout_health_check_first_wait: int = _f(
        300, "Initial delay in seconds before health checks. DeepGEMM compilation may require a longer delay."
    )

    # ── training ──
    global_batch_size: int = _f(16, "Training samples per optim step.")
    micro_batch_size: int = _f(1, "Samples per micro-batch when use_dynamic_batch_size is False.")
    lr: float = _f(5e-07, "Learning rate.")
    min_lr: float = _f(0.0, "Floor of the learning-rate schedule.")
    lr_warmup_iters: int = _f(0, "Optimizer steps of linear warm-up.")
    lr_decay_iters: int | None = _f(None, "Optimizer steps of decay; None = all optimizer steps of the run.")
    lr_decay_style: str = _f("constant", "Learning-rate schedule.")
    weight_decay: float = _f(0.1, "Weight decay.")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.98, "Adam beta2.")
    optimizer: str = _f("adam", "Optimizer name.")
    clip_grad: float = _f(1.0, "Gradient-norm clipping threshold; 0 disables clipping.")
    seed: int = _f(1234, "Random seed of the run (data order, sampling, init).")
    freeze_params_name_list: list[str] | None = _f(
        None, "Parameter-name patterns matched with re.search to select frozen weights."
    )

    # ── memory and precision ──
    attention_dropout: float = _f(0.0, "Attention dropout probability.")
    hidden_dropout: float = _f(0.0, "Hidden-layer dropout probability.")
    attention_softmax_in_fp32: bool = _f(True, "Compute attention softmax in fp32.")
    accumulate_allreduce_grads_in_fp32: bool = _f(True, "Accumulate and all-reduce gradients in fp32.")
    use_distributed_optimizer: bool = _f(
        False, "Shard optimizer state across data-parallel ranks with Megatron's distributed optimizer."
    )
    recompute_granularity: str = _f("full", "Activation recomputation granularity: 'full' or 'selective'.")
    recompute_method: str = _f("uniform", "Recomputation method: 'uniform' or 'block'.")
    recompute_num_layers: int = _f(1, "Layers per recomputation chunk.")

    # ── dynamic batching ──
    use_dynamic_batch_size: bool = _f(
        True,
        "Pack variable-length samples into micro-batches up to max_tokens_per_gpu instead of a fixed size.",
    )
    max_tokens_per_gpu: int = _f(8192, "Token budget per GPU per micro-batch when dynamic batching is on.")
    qkv_format: str = _f("thd", "QKV layout for the Megatron backend.")

    # ── eval ──
    eval_interval: int | None = _f(10, "Run eval every N rollout steps; None disables eval.")
    n_samples_per_eval_prompt: int = _f(4, "Responses sampled per eval prompt.")
    eval_max_response_len: int = _f(4096, "Max generated tokens per eval sample.")
    eval_top_p: float = _f(1.0, "Nucleus-sampling top-p for eval generation.")
    eval_config: dict[str, Any] | None = _f(None, "Evaluation defaults and datasets.")

    # ── checkpointing ──
    save: str = _f(
        "/checkpoints", "Checkpoint output directory (path or fsspec URL); '' = <output_dir>/checkpoints."
    )
    save_interval: int = _f(10, "Save a checkpoint every N rollout steps.")
    load: str = _f("", "Checkpoint directory to resume from; empty starts from the HF weights.")
    no_save_optim: bool = _f(
        False, "Omit optimizer state from checkpoints. The checkpoints cannot resume the optimizer exactly."
    )
    no_load_optim: bool = _f(False, "Do not load optimizer state when resuming.")
    megatron_to_hf_mode: str = _f(
        "", "Export mode for saved Megatron checkpoints. An empty value disables export."
    )
    slime_model_script: str = _f(
        "", "Script that defines MODEL_ARGS in place of the model's architecture (megatron)."
    )
    source_hf_checkpoint: str | None = _f(None, "Source checkpoint when it differs from the model's own.")
    megatron_conversion_hf_checkpoint: str | None = _f(
        None,
        "HF checkpoint used for the HF->Megatron conversion instead of the training model's own weights.",
    )

    # ── weight sync ──
    update_weight_mode: str = _f(
        "full", "Weight synchronization mode. 'full' sends all weights; 'delta' sends byte-level changes; 'auto' "
        "picks full or delta for each sync from the measured cost of both (fast links: full; slow links: delta)."
    )
    update_weight_transport: str = _f(
        "nccl", "'nccl' (gloo on CPU), 'disk' (needs a shared filesystem) or 'ipc' (colocated on GPU)."
    )
    update_weight_encoding: str = _f("indices", "Encoding for delta payloads.")
    update_weight_disk_dir: str = _f("", "Shared directory (path or fsspec URL) used by the disk transport.")
    update_weight_buffer_size: int = _f(512 * MiB, "Bytes per weight-sync bucket.")
    update_weight_full_interval: int = _f(0, "Send full weights every N syncs in delta mode; 0 = never.")
    update_weight_pause_mode: str = _f(
        "abort", "How engines pause generation for a sync: 'abort' or 'in_place'."
    )
    update_weight_timeout: float = _f(600.0, "Seconds one weight sync may take before it fails.")
    update_weight_double_buffer: bool = _f(
        False,
        "Engines receive the next version into a shadow copy while they keep serving the current one, then "
        "switch between two forward passes: generation pauses only for the switch (raygym's server; costs a "
        "second copy of the weights on every engine).",
    )
    update_weight_probe_tolerance: float = _f(
        0.1,
        "Engines verified by probe (stock SGLang): largest mean |log-prob difference| between the engine and "
        "the trainer on a seeded probe after a sync before it counts as failed.",
    )

    # ── custom functions (a callable, or an import path 'pkg.module:function') ──
    custom_rm_function: CustomFunction = _f(
        None,
        "Reward function, called as its signature says: fn(sample), fn(prompt, response, label, metadata), "
        "fn(samples) -> list, TRL's fn(prompts, completions, **columns) -> list[float | None] or verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info).",
    )
    custom_generate_function: CustomFunction = _f(None, "Custom generation step for one sample.")
    custom_reward_post_process_function: CustomFunction = _f(
        None, "Function applied to rewards after generation."
    )
    custom_rollout_log_function: CustomFunction = _f(None, "Function called with each rollout's data.")
    custom_eval_rollout_log_function: CustomFunction = _f(
        None, "Function called with each evaluation rollout's data."
    )
    rollout_function: CustomFunction = _f(None, "Custom rollout loop replacing the built-in one.")
    custom_megatron_before_log_prob_hook: CustomFunction = _f(
        None, "Hook run in the trainer before log-probs."
    )
    custom_megatron_before_train_step_hook: CustomFunction = _f(
        None, "Hook run in the trainer before each step."
    )

    # ── environments, LLM judge, on-policy distillation (raygym/envs, raygym/judge.py, raygym/distill.py) ──
    rollout_env: CustomFunction = _f(
        None, "Multi-turn environment: a raygym.envs.Environment class or factory ('pkg.module:Class'); each "
        "sample plays one episode; rm_type='env' (or unset) rewards it with the episode's reward.",
    )
    rollout_env_max_turns: int = _f(4, "Model turns per episode of rollout_env.")
    rollout_env_max_context_len: int | None = _f(
        None, "Prompt + response tokens an episode may fill (model and environment tokens); None = no limit."
    )
    judge_hf_checkpoint: str | None = _f(
        None, "LLM judge model: starts a judge engine group with its own GPUs; rm_type='judge' scores with it."
    )
    judge_num_engines: int = _f(1, "Judge engines (each on judge_num_gpus_per_engine GPUs of one node).")
    judge_num_gpus_per_engine: int = _f(1, "GPUs (and tensor-parallel size) per judge engine.")
    judge_prompt_template: str = _f(
        "Rate the response from 0 to 10.\nTask: {prompt}\nResponse: {response}\nScore:",
        "Judge prompt; {prompt}, {response} and {label} are filled in.",
    )
    judge_max_response_len: int = _f(16, "Tokens the judge may write; its score is the first number in them.")
    judge_score_min: float = _f(0.0, "Lowest score the template asks for (maps to reward 0).")
    judge_score_max: float = _f(10.0, "Highest score the template asks for (maps to reward 1).")
    judge_failure_score: float = _f(0.0, "Reward when the judge's answer holds no score in range.")
    judge_batch_size: int = _f(32, "Judge prompts per /generate request.")
    judge_cache_size: int = _f(4096, "Judged (prompt, response, label) triples remembered; 0 = no cache.")
    distill_teacher_checkpoint: str | None = _f(
        None, "On-policy distillation: the teacher model (its own GPUs) scores every sampled token; the "
        "per-token reverse KL becomes the advantage.",
    )
    distill_num_gpus: int = _f(1, "GPUs for the teacher (one scoring actor per GPU).")
    distill_kl_coef: float = _f(1.0, "Weight of the per-token reverse-KL advantage log p_teacher - log p_student.")
    distill_task_weight: float = _f(
        1.0, "Weight of the task reward's advantage next to the distillation term; 0 = pure distillation."
    )

    # ── SGLang ──
    sglang_mem_fraction_static: float = _f(
        0.75, "Fraction of GPU memory sglang reserves for weights + KV cache."
    )
    sglang_enable_dp_attention: bool = _f(False, "Enable data-parallel attention across engine ranks.")
    sglang_dp_size: int | None = _f(None, "Data-parallel size for the engines.")
    sglang_ep_size: int | None = _f(None, "Expert-parallel size for MoE models.")
    sglang_enable_dp_lm_head: bool = _f(False, "Data-parallel LM head paired with DP attention.")
    sglang_disable_custom_all_reduce: bool = _f(
        False, "Fall back to NCCL all-reduce instead of sglang's kernel."
    )
    sglang_cuda_graph_bs: list[int] | None = _f(None, "Batch sizes to capture CUDA graphs for.")
    sglang_cuda_graph_backend_prefill: str | None = _f(None, "CUDA-graph backend for prefill.")
    sglang_max_running_requests: int | None = _f(None, "Cap on concurrent in-flight requests per engine.")
    sglang_tool_call_parser: str | None = _f(None, "Tool-call output parser.")
    sglang_reasoning_parser: str | None = _f(None, "Parser for reasoning/thinking output.")
    sglang_config: dict[str, Any] | None = _f(None, "Extra SGLang engine settings (server arguments).")
    sglang_request_params: dict[str, Any] | None = _f(None, "Additional parameters for generation requests.")
    rollout_engine_python: str = _f(
        "",
        "Python interpreter that runs the engine server (e.g. the venv where SGLang is installed); "
        "'' = the interpreter running raygym.",
    )

    # ── overrides ──
    extra_config: dict[str, Any] | None = _f(
        None, "Values that override same-named recipe fields (keys must be Recipe field names)."
    )
    apply_chat_template_kwargs: dict[str, Any] | str = _f(
        "", "Keyword arguments for the tokenizer's apply_chat_template (a dict or JSON); '' = none."
    )
    multimodal_keys: dict[str, Any] | str | None = _f(None, "Multimodal dataset columns (a dict or JSON).")

    _choices: ClassVar[dict[str, tuple[Any, ...]]] = _RECIPE_CHOICES

    @model_validator(mode="before")
    @classmethod
    def _apply_extra_config(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field in ("train_env_vars",):
            if isinstance(data.get(field), str):
                data[field] = _parse_json_object(field, data[field])
        extra = data.get("extra_config")
        if extra is None:
            return data
        if not isinstance(extra, dict):
            raise ConfigError(f"extra_config={extra!r}: must be a dict of recipe field overrides")
        for key, value in extra.items():
            if key not in cls.model_fields or key == "extra_config":
                close = difflib.get_close_matches(str(key), list(cls.model_fields), n=3)
                raise ConfigError(
                    f"extra_config[{key!r}]: not a Recipe field; extra_config only overrides recipe fields"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
            data[key] = value
        return data

    @model_validator(mode="after")
    def _validate(self) -> Recipe:
        for field, choices in self._choices.items():
            _check_choice(field, getattr(self, field), choices)
        for field in _RECIPE_POSITIVE:
            _check_int(field, getattr(self, field), 1, optional=field in _OPTIONAL_RECIPE_FIELDS)
        for field in _RECIPE_NON_NEGATIVE:
            _check_int(field, getattr(self, field), 0, optional=True)
        self._check_ranges()
        self._check_parallelism()
        self._check_modes()
        self._check_batches()
        self._check_judge_and_teacher()
        for field in CUSTOM_FUNCTION_FIELDS:
            value = getattr(self, field)
            if value is not None and not isinstance(value, str) and not callable(value):
                raise ConfigError(f"{field}={value!r}: must be a callable or 'pkg.module:function'")
            _check_import_path(field, value)
        _check_import_path("dynamic_sampling_filter_path", self.dynamic_sampling_filter_path)
        if self.rm_type is not None and self.rm_type not in RM_TYPES:
            raise ConfigError(
                f"rm_type={self.rm_type!r}: unknown built-in reward; pass --rm-type with one of "
                f"{', '.join(map(repr, RM_TYPES))}, or --custom-rm-function pkg.module:function"
            )
        for key, weight in (self.reward_functions or {}).items():
            if key not in RM_TYPES and (not _IMPORT_PATH.match(key) or ("." not in key and ":" not in key)):
                raise ConfigError(
                    f"reward_functions key {key!r}: neither a built-in reward ({', '.join(RM_TYPES)}) nor an "
                    "import path; write it as 'pkg.module:function'"
                )
            if not math.isfinite(weight):
                raise ConfigError(f"reward_functions[{key!r}]={weight!r}: a weight must be a finite number")
        if self.rollout_stop_token_ids and min(self.rollout_stop_token_ids) < 0:
            raise ConfigError(f"rollout_stop_token_ids={self.rollout_stop_token_ids!r}: token ids are >= 0")
        _check_no_secrets("environment", self.environment)
        _check_no_secrets("train_env_vars", self.train_env_vars)
        for field in ("apply_chat_template_kwargs", "multimodal_keys"):
            if isinstance(getattr(self, field), str) and getattr(self, field):
                _parse_json_object(field, getattr(self, field))
        return self

    def _check_ranges(self) -> None:
        _check_range("lr", self.lr, 0.0, math.inf)
        _check_range("min_lr", self.min_lr, 0.0, self.lr)
        _check_range("critic_lr", self.critic_lr, 0.0, math.inf)
        _check_range("weight_decay", self.weight_decay, 0.0, math.inf)
        _check_range("adam_beta1", self.adam_beta1, 0.0, 1.0, high_open=True)
        _check_range("adam_beta2", self.adam_beta2, 0.0, 1.0, high_open=True)
        _check_range("eps_clip", self.eps_clip, 0.0, 1.0, low_open=True)
        _check_range("eps_clip_high", self.eps_clip_high, 0.0, math.inf, low_open=True)
        _check_range("eps_clip_c", self.eps_clip_c, 1.0, math.inf, low_open=True)
        _check_range("tis_clip", self.tis_clip, 0.0, math.inf, low_open=True)
        _check_range("update_weight_probe_tolerance", self.update_weight_probe_tolerance, 0.0, math.inf, low_open=True)
        for field in ("kl_loss_coef", "kl_coef", "entropy_coef", "clip_grad", "rollout_temperature"):
            _check_range(field, getattr(self, field), 0.0, math.inf)
        for field in ("rollout_top_p", "eval_top_p"):
            _check_range(field, getattr(self, field), 0.0, 1.0, low_open=True)
        for field in ("attention_dropout", "hidden_dropout"):
            _check_range(field, getattr(self, field), 0.0, 1.0, high_open=True)
        for field in ("gamma", "lambd"):
            _check_range(field, getattr(self, field), 0.0, 1.0)
        _check_range(
            "sglang_mem_fraction_static",
            self.sglang_mem_fraction_static,
            0.0,
            1.0,
            low_open=True,
            high_open=True,
        )
        for field in ("colocate_trainer_gpu_share", "colocate_engine_gpu_share"):
            _check_range(field, getattr(self, field), 0.0, 1.0, low_open=True)
        for field in ("placement_timeout", "update_weight_timeout"):
            _check_range(field, getattr(self, field), 0.0, math.inf, low_open=True)
        if self.colocate and self.colocate_trainer_gpu_share + self.colocate_engine_gpu_share > 1.0 + 1e-9:
            raise ConfigError(
                f"colocate_trainer_gpu_share={self.colocate_trainer_gpu_share} + colocate_engine_gpu_share="
                f"{self.colocate_engine_gpu_share} exceed one GPU; lower them so they sum to at most 1.0"
            )

    def _check_parallelism(self) -> None:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        if self.sequence_parallel and tp <= 1:
            raise ConfigError(
                f"sequence_parallel=True needs tensor_model_parallel_size > 1 (got {tp}); "
                "set --tensor-model-parallel-size 2 or more, or pass --no-sequence-parallel"
            )
        actor_gpus = self.actor_num_nodes * self.actor_num_gpus_per_node
        if actor_gpus % (tp * pp * cp):
            raise ConfigError(
                f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x context_parallel_size={cp}"
                f" = {tp * pp * cp} does not divide the actor's {actor_gpus} GPUs "
                "(actor_num_nodes x actor_num_gpus_per_node); pick sizes whose product divides it"
            )
        ep = self.expert_model_parallel_size
        if actor_gpus % (ep * pp):
            raise ConfigError(
                f"expert_model_parallel_size={ep} x pipeline_model_parallel_size={pp} does not divide the actor's "
                f"{actor_gpus} GPUs; pick an expert-parallel size that divides {actor_gpus // pp}"
            )
        if self.actor_num_gpus_per_node % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"rollout_num_gpus_per_engine={self.rollout_num_gpus_per_engine}: an engine must fit inside one "
                f"node of actor_num_gpus_per_node={self.actor_num_gpus_per_node} GPUs; pick a divisor of it"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.gpu_allocation()

    def _check_modes(self) -> None:
        if self.async_mode and self.colocate:
            raise ConfigError(
                "async_mode=True cannot run with colocate=True: rollout and training overlap and need their "
                "own GPUs; pass --no-colocate (and --rollout-num-gpus) or --no-async-mode"
            )
        if self.update_weight_mode == "delta" and self.colocate:
            raise ConfigError(
                "update_weight_mode='delta' with colocate=True: colocated engines receive weights by handle, a "
                "delta saves nothing; use --update-weight-mode full or pass --no-colocate"
            )
        if self.update_weight_transport == "disk" and not self.update_weight_disk_dir:
            raise ConfigError(
                "update_weight_transport='disk' needs update_weight_disk_dir: set --update-weight-disk-dir to a "
                "directory (or fsspec URL) that trainers and engines share"
            )
        if self.update_weight_transport == "ipc" and not self.colocate:
            raise ConfigError(
                "update_weight_transport='ipc' needs colocate=True (handles only work on the same GPU); "
                "use --update-weight-transport nccl or pass --colocate"
            )
        if self.update_weight_double_buffer and self.colocate:
            raise ConfigError(
                "update_weight_double_buffer=True with colocate=True: colocated engines release their memory for "
                "training and receive weights by handle, there is nothing to serve from during a sync; pass "
                "--no-update-weight-double-buffer or --no-colocate"
            )
        if self.rollout_engine != "auto":
            check_weight_sync(self.rollout_engine, mode=self.update_weight_mode,
                              transport=self.update_weight_transport, colocate=self.colocate,
                              double_buffer=self.update_weight_double_buffer)
        if self.advantage_estimator == "ppo" and not self.use_critic:
            raise ConfigError(
                "advantage_estimator='ppo' needs use_critic=True (PPO learns a value function); pass --use-critic"
            )

    def _check_batches(self) -> None:
        per_step = self.rollout_batch_size * self.n_samples_per_prompt
        if per_step % self.global_batch_size:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not divide rollout_batch_size x "
                f"n_samples_per_prompt = {self.rollout_batch_size} x {self.n_samples_per_prompt} = {per_step}; "
                f"pick a divisor of {per_step}"
            )
        dp = self.data_parallel_size()
        if self.global_batch_size % dp:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size {dp} "
                "(actor GPUs / (tensor x pipeline x context parallel)); pick a multiple of it"
            )
        if not self.use_dynamic_batch_size and (self.global_batch_size // dp) % self.micro_batch_size:
            raise ConfigError(
                f"micro_batch_size={self.micro_batch_size} does not divide the {self.global_batch_size // dp} "
                "samples per data-parallel rank and step; pick a divisor, or --use-dynamic-batch-size"
            )
        if (
            self.over_sampling_batch_size is not None
            and self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ConfigError(
                f"over_sampling_batch_size={self.over_sampling_batch_size} is smaller than rollout_batch_size="
                f"{self.rollout_batch_size}; set it to at least {self.rollout_batch_size} or leave it unset"
            )

    def _check_judge_and_teacher(self) -> None:
        """The environment's, the judge's and the teacher's fields (raygym/envs, judge.py, distill.py)."""
        if self.rollout_env is not None and self.custom_generate_function is not None:
            raise ConfigError(
                "rollout_env and custom_generate_function are both set: an environment run generates its "
                "episodes itself; keep one of them"
            )
        if self.rm_type == "env" and self.rollout_env is None:
            raise ConfigError("rm_type='env' rewards environment episodes: set rollout_env too, or another rm_type")
        if self.rm_type == "judge" and not self.judge_hf_checkpoint:
            raise ConfigError("rm_type='judge' needs judge_hf_checkpoint: set --judge-hf-checkpoint to the judge model")
        if not self.judge_score_max > self.judge_score_min:
            raise ConfigError(
                f"judge_score_min={self.judge_score_min} must be below judge_score_max={self.judge_score_max}; "
                "set them to the score range judge_prompt_template asks for"
            )
        if self.judge_hf_checkpoint:
            if self.actor_num_gpus_per_node % self.judge_num_gpus_per_engine:
                raise ConfigError(
                    f"judge_num_gpus_per_engine={self.judge_num_gpus_per_engine}: a judge engine must fit in one "
                    f"node of actor_num_gpus_per_node={self.actor_num_gpus_per_node} GPUs; pick a divisor of it"
                )
            import string as _string

            try:
                names = {n for _, n, _, _ in _string.Formatter().parse(self.judge_prompt_template) if n is not None}
            except ValueError as exc:
                raise ConfigError(
                    f"judge_prompt_template={self.judge_prompt_template!r}: not a format string ({exc})"
                ) from None
            if "response" not in names or not names <= {"prompt", "response", "label"}:
                raise ConfigError(
                    f"judge_prompt_template={self.judge_prompt_template!r}: use {{response}} (and optionally "
                    "{prompt}, {label}) and write literal braces as {{ }}"
                )
        _check_range("distill_kl_coef", self.distill_kl_coef, 0.0, math.inf)
        _check_range("distill_task_weight", self.distill_task_weight, 0.0, math.inf)

    def auxiliary_gpus(self) -> int:
        """GPUs of the judge engines and the distillation teacher, outside ``gpu_allocation()``."""
        judge = self.judge_num_engines * self.judge_num_gpus_per_engine if self.judge_hf_checkpoint else 0
        return judge + (self.distill_num_gpus if self.distill_teacher_checkpoint else 0)

    # ── derived quantities ──

    def gpu_allocation(self) -> GpuAllocation:
        """GPUs per role, engines and nodes (see :func:`raygym.allocation.compute_allocation`)."""
        return compute_allocation(
            actor_num_nodes=self.actor_num_nodes,
            actor_num_gpus_per_node=self.actor_num_gpus_per_node,
            colocate=self.colocate,
            rollout_num_gpus=self.rollout_num_gpus,
            rollout_num_gpus_per_engine=self.rollout_num_gpus_per_engine,
            use_critic=self.use_critic,
            critic_num_nodes=self.critic_num_nodes,
            critic_num_gpus_per_node=self.critic_num_gpus_per_node,
        )

    def total_nodes(self) -> int:
        """Nodes the run needs (actor + critic + disaggregated rollout)."""
        return self.gpu_allocation().total_nodes

    def data_parallel_size(self) -> int:
        """Actor GPUs / (TP x PP x CP)."""
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        return (self.actor_num_nodes * self.actor_num_gpus_per_node) // model_parallel

    def validate_model_parallelism(self, model: ModelConfig) -> None:
        """Check the parallel sizes against the model's architecture, where the architecture is known."""
        ep, pp = self.expert_model_parallel_size, self.pipeline_model_parallel_size
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

    def cli_args(self) -> list[str]:
        """The recipe as kebab-case flags (``--n-samples-per-prompt 8``); see ``TrainConfig.cli_args``."""
        return _encode_section("recipe", self)

    def __eq__(self, other: object) -> bool:
        # A function and its import path name the same function: equal (so CLI round trips are exact).
        if not isinstance(other, Recipe):
            return NotImplemented
        mine, theirs = self.field_values(), other.field_values()
        for field in CUSTOM_FUNCTION_FIELDS:
            mine[field] = _callable_identity(mine[field])
            theirs[field] = _callable_identity(theirs[field])
        return mine == theirs

    __hash__ = None  # type: ignore[assignment]


_OPTIONAL_RECIPE_FIELDS = frozenset(
    name for name, info in Recipe.model_fields.items() if type(None) in typing.get_args(info.annotation)
)


def _parse_json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f'{field}={text!r}: not valid JSON ({exc}); pass a JSON object like \'{{"k": "v"}}\''
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f'{field}={text!r}: must be a JSON object, like \'{{"k": "v"}}\'')
    return value


# ── model, data, metrics ─────────────────────────────────────────────────────────────────────────


class ModelConfig(_Section):
    """The policy model: where the weights are and, optionally, its architecture.

    >>> ModelConfig(hf_checkpoint="builtin:tiny-qwen3").dtype
    'auto'
    """

    hf_checkpoint: str = _f(
        ..., "HF checkpoint: a local path, an fsspec URL, an HF id or 'builtin:tiny-qwen3'."
    )
    ref_checkpoint: str | None = _f(None, "Reference model for KL terms; None = the initial policy weights.")
    dtype: str = _f("auto", "Parameter dtype: 'auto', 'bfloat16', 'float16' or 'float32'.")
    tokenizer: str | None = _f(None, "Tokenizer path or id; None = the checkpoint's own.")
    trust_remote_code: bool = _f(False, "Allow custom model code from the checkpoint.")
    num_experts: int | None = _f(None, "MoE experts per layer (None for dense models or unknown).")
    moe_router_topk: int | None = _f(None, "Experts each token is routed to (MoE).")
    num_layers: int | None = _f(None, "Transformer layers (optional; checked against pipeline parallelism).")
    hidden_size: int | None = _f(None, "Hidden size (optional; informational).")

    @model_validator(mode="after")
    def _validate(self) -> ModelConfig:
        if not self.hf_checkpoint.strip():
            raise ConfigError(
                "hf_checkpoint='': required; set --hf-checkpoint to a path, URL or 'builtin:tiny-qwen3'"
            )
        _check_choice("dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        for field in ("num_experts", "moe_router_topk", "num_layers", "hidden_size"):
            _check_int(field, getattr(self, field), 1, optional=True)
        return self


class DatasetConfig(_Section):
    """The prompt data: a jsonl/parquet file (path or fsspec URL) or ``builtin:next-digit``.

    >>> DatasetConfig(prompt_data="gsm8k.jsonl", input_key="question", label_key="answer").format
    'auto'
    """

    prompt_data: str = _f(
        "builtin:next-digit", "Training prompts: a jsonl/parquet path or fsspec URL, or builtin:."
    )
    input_key: str = _f("prompt", "Column holding the prompt (a string or a list of chat messages).")
    label_key: str | None = _f("label", "Column holding the label passed to the reward function.")
    metadata_key: str | None = _f(
        "metadata", "Column holding per-row metadata passed to the reward function."
    )
    apply_chat_template: bool = _f(False, "Format prompts with the tokenizer's chat template.")
    apply_chat_template_kwargs: dict[str, Any] = _fd(dict, "Keyword arguments for apply_chat_template.")
    eval_prompt_data: dict[str, str] = _fd(dict, "Eval datasets: name -> path or fsspec URL.")
    format: str = _f("auto", "File format: 'auto' (from the extension), 'jsonl' or 'parquet'.")

    @model_validator(mode="after")
    def _validate(self) -> DatasetConfig:
        if not self.prompt_data.strip():
            raise ConfigError("prompt_data='': required; set --prompt-data to a jsonl/parquet path or URL")
        if not self.input_key:
            raise ConfigError("input_key='': required; set --input-key to the prompt column (e.g. 'prompt')")
        if self.label_key and self.label_key == self.input_key:
            raise ConfigError(
                f"label_key={self.label_key!r} equals input_key; they must name different columns (--label-key)"
            )
        _check_choice("format", self.format, ("auto", "jsonl", "parquet"))
        return self


class MetricsConfig(_Section):
    """Where metrics go besides ``metrics.jsonl`` (always written). The W&B key is read from
    ``WANDB_API_KEY`` in the environment, never from a config."""

    wandb_project: str | None = _f(None, "W&B project; None disables W&B.")
    wandb_group: str | None = _f(None, "W&B group.")
    wandb_name: str | None = _f(None, "W&B run name; None = the run id.")
    wandb_mode: str = _f("online", "W&B mode: 'online', 'offline' or 'disabled'.")
    tensorboard_dir: str | None = _f(None, "TensorBoard log directory; None disables TensorBoard.")

    @model_validator(mode="after")
    def _validate(self) -> MetricsConfig:
        _check_choice("wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        return self


def new_run_id() -> str:
    """A fresh run id: UTC timestamp plus 6 random hex digits, e.g. ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class TrainConfig(BaseModel):
    """Everything a run needs. ``run_id`` is minted once, at construction, and kept.

    >>> cfg = TrainConfig(model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"), output_dir="/tmp/run1")
    >>> cfg.run_dir, cfg.checkpoint_dir
    ('/tmp/run1', '/checkpoints')
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    recipe: Recipe = _fd(Recipe, "The training recipe.")
    model: ModelConfig = _f(..., "The policy model.")
    dataset: DatasetConfig = _fd(DatasetConfig, "The prompt data.")
    metrics: MetricsConfig = _fd(MetricsConfig, "Metric sinks besides metrics.jsonl.")
    output_dir: str | None = _f(None, "Run directory (path or fsspec URL); None = runs/<run_id>.")
    run_id: str = _fd(new_run_id, "Stable id of the run; generated once when unset.")

    def __init__(self, **data: Any) -> None:
        if data.get("run_id") is None:
            data.pop("run_id", None)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error_from(exc, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any):  # type: ignore[override]
        if isinstance(obj, dict) and obj.get("run_id") is None:
            obj = {k: v for k, v in obj.items() if k != "run_id"}
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise _config_error_from(exc, cls) from None

    @model_validator(mode="after")
    def _validate(self) -> TrainConfig:
        if not _RUN_ID.match(self.run_id):
            raise ConfigError(
                f"run_id={self.run_id!r}: use letters, digits, '.', '_' and '-' only (--run-id)"
            )
        self.recipe.validate_model_parallelism(self.model)
        return self

    @property
    def run_dir(self) -> str:
        """Where the run writes: ``output_dir``, or ``runs/<run_id>``."""
        return self.output_dir if self.output_dir else f"runs/{self.run_id}"

    @property
    def checkpoint_dir(self) -> str:
        """``recipe.save``, or ``<run_dir>/checkpoints`` when it is empty."""
        return self.recipe.save or f"{self.run_dir.rstrip('/')}/checkpoints"

    def chat_template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template kwargs: the recipe's (dict or JSON), updated by the dataset's."""
        base = self.recipe.apply_chat_template_kwargs
        merged = (
            _parse_json_object("apply_chat_template_kwargs", base) if isinstance(base, str) and base else {}
        )
        if isinstance(base, dict):
            merged = dict(base)
        return {**merged, **self.dataset.apply_chat_template_kwargs}

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (custom functions as import paths); ``model_validate`` reads it back."""
        recipe = self.recipe.field_values()
        for field in CUSTOM_FUNCTION_FIELDS:
            if recipe[field] is not None:
                try:
                    recipe[field] = callable_import_path(recipe[field], field)
                except ConfigError:
                    recipe[field] = f"<unimportable {recipe[field]!r}>"
        return json.loads(
            json.dumps(
                {
                    "recipe": recipe,
                    "model": self.model.model_dump(),
                    "dataset": self.dataset.model_dump(),
                    "metrics": self.metrics.model_dump(),
                    "output_dir": self.output_dir,
                    "run_id": self.run_id,
                }
            )
        )

    def cli_args(self) -> list[str]:
        """Every field as slime-style kebab flags; ``TrainConfig.from_cli_args`` reads them back exactly.

        Booleans are ``--x``/``--no-x``, None is ``--no-x`` (optional fields), dicts and lists are
        JSON, custom functions are import paths (a lambda raises ConfigError).
        """
        args: list[str] = []
        for section in _SECTIONS:
            args += _encode_section(section, self if section == "run" else getattr(self, section))
        return args

    @classmethod
    def from_cli_args(cls, args: Sequence[str]) -> TrainConfig:
        """Build a config from flags: ``[--preset NAME] [@ run.toml] [--flag value ...]``.

        Layers, later wins: the preset (``tiny`` when neither a preset nor ``--hf-checkpoint`` is
        given anywhere), then TOML files in order, then flags. Bad input raises ConfigError.
        """
        return _from_cli_args(list(args))


# ── flags: one table generated from the models ───────────────────────────────────────────────────

_SECTIONS = ("recipe", "model", "dataset", "metrics", "run")
_SECTION_MODELS: dict[str, type[BaseModel]] = {
    "recipe": Recipe,
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "metrics": MetricsConfig,
    "run": TrainConfig,
}
_RUN_FIELDS = ("output_dir", "run_id")


class _FlagSpec(typing.NamedTuple):
    section: str
    field: str
    flag: str  # without the leading "--"
    kind: str  # "bool" | "int" | "float" | "str" | "json" | "function"
    optional: bool
    help: str


def _classify(annotation: Any) -> tuple[str, bool]:
    """(kind, optional) of a field's annotation."""
    origin = typing.get_origin(annotation)
    members = typing.get_args(annotation) if origin in (Union, types.UnionType) else (annotation,)
    optional = type(None) in members
    rest = [m for m in members if m is not type(None)]
    if any(typing.get_origin(m) is Callable or m is Callable for m in rest):
        return "function", optional
    if len(rest) == 1 and rest[0] in (bool, int, float, str):
        return rest[0].__name__, optional
    return "json", optional


def _build_flag_table() -> list[_FlagSpec]:
    specs: list[_FlagSpec] = []
    taken: set[str] = set()
    for section in _SECTIONS:
        model = _SECTION_MODELS[section]
        names = _RUN_FIELDS if section == "run" else tuple(model.model_fields)
        for field in names:
            info = model.model_fields[field]
            kind, optional = _classify(info.annotation)
            flag = field.replace("_", "-")
            if flag in taken:  # same name in two sections: the later one is prefixed
                flag = f"{section}-{flag}"
            if kind == "bool" and optional:
                raise TypeError(f"{section}.{field}: optional booleans have no flag form")
            specs.append(_FlagSpec(section, field, flag, kind, optional, info.description or ""))
            taken.add(flag)
    every = [s.flag for s in specs] + [f"no-{s.flag}" for s in specs if s.kind == "bool" or s.optional]
    if len(every) != len(set(every)):
        raise TypeError(
            "generated flags collide: " + ", ".join(sorted({f for f in every if every.count(f) > 1}))
        )
    return specs


FLAGS: list[_FlagSpec] = _build_flag_table()
_FLAG_BY_NAME = {spec.flag: spec for spec in FLAGS}


def _encode_value(spec: _FlagSpec, value: Any) -> str:
    if spec.kind == "json":
        return json.dumps(value, sort_keys=True)
    if spec.kind == "function":
        return callable_import_path(value, spec.field)
    if spec.kind == "float":
        return repr(float(value))
    return str(value)


def _encode_section(section: str, obj: BaseModel) -> list[str]:
    args: list[str] = []
    for spec in FLAGS:
        if spec.section != section:
            continue
        value = getattr(obj, spec.field)
        if spec.kind == "bool":
            args.append(f"--{spec.flag}" if value else f"--no-{spec.flag}")
        elif value is None:
            args.append(f"--no-{spec.flag}")
        else:
            text = _encode_value(spec, value)
            # Values that look like flags or TOML includes travel glued to their flag.
            args += [f"--{spec.flag}={text}"] if text.startswith(("-", "@")) else [f"--{spec.flag}", text]
    return args


def _decode_value(spec: _FlagSpec, text: str) -> Any:
    try:
        if spec.kind == "int":
            if not re.fullmatch(r"[+-]?\d+", text.strip()):
                raise ValueError("not a whole number")
            return int(text)
        if spec.kind == "float":
            return float(text)
        if spec.kind == "json":
            if (
                spec.field == "apply_chat_template_kwargs"
                and spec.section == "recipe"
                and not text.startswith(("{", '"'))
            ):
                return text  # a bare JSON string of kwargs is kept as written
            return json.loads(text)
    except ValueError as exc:
        expected = {"int": "a whole number", "float": "a number", "json": "JSON"}[spec.kind]
        raise ConfigError(f"{spec.field}={text!r}: --{spec.flag} expects {expected} ({exc})") from None
    return text


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message}; run with --help for the flags")


def build_arg_parser(prog: str = "raygym train") -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (its values land as raw strings)."""
    parser = _RaisingParser(prog=prog, allow_abbrev=False, add_help=False, argument_default=argparse.SUPPRESS)
    parser.add_argument(
        "--preset", dest="__preset", metavar="NAME", help="Base recipe (see raygym.presets.PRESETS)."
    )
    titles = {"recipe": "recipe", "model": "model", "dataset": "dataset", "metrics": "metrics", "run": "run"}
    for section in _SECTIONS:
        group = parser.add_argument_group(titles[section])
        for spec in (s for s in FLAGS if s.section == section):
            dest = f"{spec.section}.{spec.field}"
            choices = Recipe._choices.get(spec.field) if spec.section == "recipe" else None
            extra = f" Choices: {', '.join(map(repr, choices))}." if choices else ""
            if spec.kind == "bool":
                group.add_argument(
                    f"--{spec.flag}", dest=dest, action="store_const", const=True, help=spec.help + extra
                )
                group.add_argument(
                    f"--no-{spec.flag}", dest=dest, action="store_const", const=False, help=argparse.SUPPRESS
                )
                continue
            metavar = {"json": "JSON", "function": "PKG.MOD:FN"}.get(spec.kind, spec.kind.upper())
            group.add_argument(f"--{spec.flag}", dest=dest, metavar=metavar, help=spec.help + extra)
            if spec.optional:
                group.add_argument(
                    f"--no-{spec.flag}", dest=dest, action="store_const", const=None, help=argparse.SUPPRESS
                )
    return parser


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    return build_arg_parser()


def format_cli_help(prog: str = "raygym train") -> str:
    """Help text for every flag (booleans also take ``--no-x``; optional fields take ``--no-x`` for None)."""
    return build_arg_parser(prog).format_help()


_VALUE_FLAGS = {f"--{s.flag}" for s in FLAGS if s.kind != "bool"} | {"--preset"}


def _split_toml_includes(args: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``@ file.toml`` / ``@file.toml`` includes from flags (values that start with @ stay)."""
    flags: list[str] = []
    files: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token in _VALUE_FLAGS and i + 1 < len(args):
            flags += [token, args[i + 1]]
            i += 2
            continue
        if token == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a TOML file, e.g. '@ run.toml'")
            files.append(args[i + 1])
            i += 2
            continue
        if token.startswith("@"):
            files.append(token[1:])
        else:
            flags.append(token)
        i += 1
    return flags, files


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    """Read a TOML run file (local path or fsspec URL) into ``{section: {field: value}}``.

    Tables ``[recipe] [model] [dataset] [metrics]`` or flat keys; top-level ``preset``,
    ``output_dir`` and ``run_id``.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    import fsspec

    try:
        with fsspec.open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"TOML file {path!r} does not exist; check the path after '@'") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"TOML file {path!r} is not valid TOML: {exc}") from None
    out: dict[str, dict[str, Any]] = {section: {} for section in (*_SECTIONS, "preset")}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in ("recipe", "model", "dataset", "metrics") and isinstance(value, dict):
            model = _SECTION_MODELS[key]
            for field, item in value.items():
                field = field.replace("-", "_")
                if field not in model.model_fields:
                    close = difflib.get_close_matches(field, list(model.model_fields), n=3)
                    raise ConfigError(
                        f"{path}: [{key}] {field}: not a field of {model.__name__}"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                    )
                out[key][field] = item
        elif key == "preset":
            out["preset"]["name"] = value
        elif key in _RUN_FIELDS:
            out["run"][key] = value
        else:
            section = next(
                (
                    s
                    for s in ("recipe", "model", "dataset", "metrics")
                    if key in _SECTION_MODELS[s].model_fields
                ),
                None,
            )
            if section is None:
                every = [f for s in _SECTIONS for f in _SECTION_MODELS[s].model_fields]
                close = difflib.get_close_matches(key, every, n=3)
                raise ConfigError(
                    f"{path}: {key}: not a config field"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
            out[section][key] = value
    return out


# Python 3.11's argparse turns ``--flag=--`` into an empty list: the value travels under this stand-in.
_DOUBLE_DASH = "\x00--"


def _from_cli_args(args: list[str]) -> TrainConfig:
    flag_args, toml_files = _split_toml_includes(args)
    flag_args = [a[:-2] + _DOUBLE_DASH if a.startswith("--") and a.endswith("=--") else a for a in flag_args]
    parsed = vars(_cached_parser().parse_args(flag_args))
    parsed = {dest: "--" if raw == _DOUBLE_DASH else raw for dest, raw in parsed.items()}
    layers: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    preset_name: str | None = None
    for path in toml_files:
        loaded = load_toml(path)
        preset_name = loaded["preset"].get("name", preset_name)
        for section in _SECTIONS:
            layers[section].update(loaded[section])
    preset_name = parsed.pop("__preset", preset_name)
    for dest, raw in parsed.items():
        section, field = dest.split(".", 1)
        spec = next(s for s in FLAGS if s.section == section and s.field == field)
        layers[section][field] = _decode_value(spec, raw) if isinstance(raw, str) else raw

    if preset_name is None and "hf_checkpoint" not in layers["model"]:
        preset_name = "tiny"
    recipe_values: dict[str, Any] = {}
    model_values: dict[str, Any] = {}
    if preset_name is not None:
        from raygym import presets

        recipe_values = presets.get_preset(preset_name).field_values()
        if "hf_checkpoint" not in layers["model"]:
            model_values = presets.default_model(preset_name).field_values()
    return TrainConfig(
        recipe=Recipe(**{**recipe_values, **layers["recipe"]}),
        model=ModelConfig(**{**model_values, **layers["model"]}),
        dataset=DatasetConfig(**layers["dataset"]),
        metrics=MetricsConfig(**layers["metrics"]),
        **layers["run"],
    )
