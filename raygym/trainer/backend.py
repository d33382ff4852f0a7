"""The trainer backend interface (``TrainerBackend``) and the settings every backend reads.

A backend owns one data-parallel rank of the policy (or critic) model. ``TrainerActor`` picks one by
``recipe.trainer_backend`` and forwards to it; the torch backend (``torch_backend.py``) and the Megatron
backend (``megatron_backend.py``) implement this contract:

- ``init() -> dict``: load the HF checkpoint, build optimizer and schedule, join the torch.distributed
  world (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); returns facts (rank, world, params).
- ``compute_log_probs(batch) -> LogProbResult``: for EVERY sample of ``batch`` (each rank gets the whole
  batch, computes its share, and the results are gathered so every rank returns the same): ``log_probs``
  (policy), ``ref_log_probs`` when a reference model is used (``use_kl_loss`` or ``kl_coef``; loaded from
  ``ref_load``, else the initial policy weights), ``entropy`` when asked, ``values`` for a critic. 1-D
  float32 CPU tensors, one per response token. Logits are divided by ``rollout_temperature`` before the
  log-softmax, as the rollout engine does.
- ``train_step(batch, rollout_id) -> TrainMetrics``: one rollout's training. Every rank receives the
  whole batch; it is cut into ``len(batch) // global_batch_size`` optimizer steps of consecutive samples,
  each step's samples are spread over ranks, packed into micro-batches and accumulated. The loss is
  :func:`raygym.algo.rl_loss`; metrics are reduced over ranks (identical on every rank) and carry the
  same keys on every backend (``raygym.trainer.contract.TrainMetrics``). Without ``old_log_probs`` the
  backend computes them first, or, with one optimizer step per rollout (``single_pass_log_probs`` in the
  facts of ``init``), takes its own detached training log-probs.
- ``iter_hf_weights(dtype=None)``: yields ``(hf_name, tensor)`` for every weight in HF naming, a tied one
  once (``model.embed_tokens.weight``, no ``lm_head.weight``); a collective under sharding: every rank
  must iterate; rank 0 gets full tensors, other ranks may get None.
- ``offload()`` / ``onload()``: move params, grads and optimizer state to host memory and back (colocate).
- ``checkpoint_state(include_optimizer) -> CheckpointState``: THIS rank's blocks of the weights (fp32,
  HF names and shapes), optimizer state, schedule position and RNG, for ``raygym.checkpoint.sharded`` (a
  collective under sharding; nothing is gathered). ``load_checkpoint_state(state, load_optimizer)``
  restores from such a state, once DCP has filled it in place.
- ``save_hf(out_dir)``: write an HF model directory (rank 0 writes; every rank calls).
- ``model_path``: the local HF directory of the policy's initial weights (config and tokenizer files).

Hooks ``custom_megatron_before_log_prob_hook`` / ``custom_megatron_before_train_step_hook`` (callable or
import path ``pkg.mod:fn``) are called as ``hook(args, rollout_id, batch)`` where ``args`` is the recipe
(``TrainerSettings.hook_recipe``, set only when a hook is; nothing else in a trainer reads the recipe),
``rollout_id`` the step (-1 when unknown) and
``batch`` the whole ``TrainBatch``; a hook that returns a ``TrainBatch`` replaces the batch.
"""

from __future__ import annotations

import datetime
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raygym.algo.rl_loss import RLLossConfig
from raygym.callables import load_callable
from raygym.checkpoint.state import CheckpointState
from raygym.config.base import CustomFunction
from raygym.config.recipe import Recipe
from raygym.config.views import build_view, recipe_view
from raygym.errors import ConfigError
from raygym.trainer.contract import LogProbResult

if TYPE_CHECKING:
    from raygym.config.run import TrainConfig
    from raygym.trainer.batch import TrainBatch


@recipe_view(extras=("hf_checkpoint", "ref_load", "dtype", "declared_architecture", "loss", "engine_threads",
                     "hook_recipe"))
@dataclass(frozen=True)
class TrainerSettings:
    """What a trainer backend reads: the Recipe's fields under their own names, plus the extras below.

    Built by :meth:`from_config` from a validated ``TrainConfig`` (see :mod:`raygym.config.views`).
    """

    # extras: from the model config and the run
    hf_checkpoint: str  # the policy's initial weights (model.hf_checkpoint)
    ref_load: str  # the reference model: recipe.ref_load, else model.ref_checkpoint ('' = the initial weights)
    dtype: str  # model.dtype: the compute dtype
    declared_architecture: dict[str, int]  # model.num_layers / hidden_size / num_experts / moe_router_topk set
    loss: RLLossConfig  # the loss view of the recipe (raygym.algo.rl_loss)
    engine_threads: int  # CPU threads of engines decoding while this trainer trains (0 unless async, not colocated)
    hook_recipe: Recipe | None = field(repr=False, compare=False)  # a custom_megatron_* hook's first argument
    cpu_placement: str  # "disjoint": pinned to its own cores while engines decode beside it (cpu_training_cores)
    # optimizer
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int | None  # None = every optimizer step of the run
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    optimizer: str
    clip_grad: float
    critic_lr: float | None
    value_clip: float | None
    # batching
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    global_batch_size: int
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int
    balance_data: bool
    # algorithm
    advantage_estimator: str
    eps_clip: float
    use_tis: bool
    use_kl_loss: bool
    kl_coef: float
    use_critic: bool
    rollout_temperature: float
    use_rollout_routing_replay: bool  # MoE: force the engine's routed experts (raygym.trainer.routing_replay)
    # model and process group
    trainer_backend: str
    tensor_model_parallel_size: int
    sequence_parallel: bool
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    recompute_granularity: str  # the Megatron backend's (raygym.trainer.megatron_model.MegatronOptions)
    recompute_method: str
    recompute_num_layers: int
    qkv_format: str
    attention_softmax_in_fp32: bool
    accumulate_allreduce_grads_in_fp32: bool
    use_distributed_optimizer: bool
    freeze_params_name_list: list[str] | None
    lora_rank: int  # > 0: train LoRA adapters (raygym.trainer.lora) instead of every weight
    lora_alpha: int
    lora_dropout: float
    lora_target_modules: str
    attention_dropout: float
    hidden_dropout: float
    torch_activation_checkpointing: bool
    seed: int
    distributed_timeout_minutes: int
    custom_megatron_before_log_prob_hook: CustomFunction
    custom_megatron_before_train_step_hook: CustomFunction
    # checkpoints
    save: str
    load: str
    no_save_optim: bool
    no_load_optim: bool
    start_rollout_id: int | None

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> TrainerSettings:
        """The trainer's view of ``cfg``.

        >>> from raygym.config import ModelConfig, Recipe, TrainConfig
        >>> s = TrainerSettings.from_config(TrainConfig(recipe=Recipe(lr=1e-5), model=ModelConfig(hf_checkpoint="m")))
        >>> s.lr, s.hf_checkpoint, s.ref_load, s.distributed_timeout_minutes
        (1e-05, 'm', '', 10)
        """
        recipe, model = cfg.recipe, cfg.model
        shape = {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
                 "num_experts": model.num_experts, "moe_router_topk": model.moe_router_topk}
        # In async_mode and fully_async (never colocated) raygym's CPU servers decode on Recipe.engine_cores while
        # the trainer trains (raygym.engines.launch.sglang.raygym_cpu_threads); a synchronous step leaves them idle.
        engine_threads = recipe.engine_cores if recipe.engines_overlap_training else 0
        hooked = recipe.custom_megatron_before_log_prob_hook or recipe.custom_megatron_before_train_step_hook
        return build_view(
            cls, recipe, hf_checkpoint=model.hf_checkpoint, ref_load=recipe.ref_load or model.ref_checkpoint or "",
            dtype=model.dtype, declared_architecture={k: v for k, v in shape.items() if v is not None},
            loss=RLLossConfig.from_recipe(recipe), engine_threads=engine_threads,
            hook_recipe=recipe if hooked else None,
        )

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.kl_coef != 0.0

    @property
    def dist_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(minutes=self.distributed_timeout_minutes)

    def total_optimizer_steps(self) -> int:
        return max(
            1,
            self.num_rollout
            * (self.rollout_batch_size * self.n_samples_per_prompt)
            // self.global_batch_size,
        )


def call_hook(settings: TrainerSettings, field_name: str, rollout_id: int, batch: Any) -> Any:
    """Run the hook ``field_name`` (``custom_megatron_before_log_prob_hook`` or
    ``custom_megatron_before_train_step_hook``) if set; returns the (possibly replaced) batch."""
    hooks = {"custom_megatron_before_log_prob_hook": settings.custom_megatron_before_log_prob_hook,
             "custom_megatron_before_train_step_hook": settings.custom_megatron_before_train_step_hook}
    hook = load_callable(hooks[field_name], field_name)
    if hook is None:
        return batch
    result = hook(settings.hook_recipe, rollout_id, batch)
    return batch if result is None else result


# ModelConfig's architecture fields and the HF config.json keys that hold the same facts.
ARCHITECTURE_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_experts": "num_experts",
                     "moe_router_topk": "num_experts_per_tok"}


def check_declared_architecture(settings: TrainerSettings, hf_config: Mapping[str, Any]) -> None:
    """ConfigError when the model config declares an architecture fact (``num_layers``, ``hidden_size``,
    ``num_experts``, ``moe_router_topk``) that the checkpoint's ``config.json`` (``hf_config``) contradicts.

    >>> from raygym.config import ModelConfig, TrainConfig
    >>> s = TrainerSettings.from_config(TrainConfig(model=ModelConfig(hf_checkpoint="m", hidden_size=64)))
    >>> check_declared_architecture(s, {"hidden_size": 64})
    >>> check_declared_architecture(s, {"hidden_size": 32})
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: hidden_size=64: the checkpoint m has hidden_size=32 in its config.json; set --hidden-size 32 or leave it unset
    """
    for name, declared in settings.declared_architecture.items():
        key = ARCHITECTURE_KEYS[name]
        actual = hf_config.get(key)
        if actual != declared:
            raise ConfigError(
                f"{name}={declared}: the checkpoint {settings.hf_checkpoint} has {key}={actual} in its config.json; "
                + (f"set --{name.replace('_', '-')} {actual} or leave it unset" if actual is not None
                   else f"leave --{name.replace('_', '-')} unset")
            )


def reference_model_path(settings: TrainerSettings, policy_path: str) -> str:
    """The local HF directory the reference model loads: ``ref_load`` when set (it must be a loadable HF
    model directory: a ConfigError otherwise, never a silent switch to the policy), else the policy's own
    initial weights ``policy_path``."""
    if not settings.ref_load:
        return policy_path
    from raygym.builtin import resolve_model_path

    path = resolve_model_path(settings.ref_load)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"ref_load={settings.ref_load!r}: not a loadable HF model directory (no config.json there); give a "
            "local HF model directory, an fsspec URL of one or 'builtin:tiny-qwen3', or leave ref_load empty to "
            "use the initial policy weights as the reference"
        )
    return path


def check_policy_batch(batch: Any, loss_config: Any) -> None:
    """ConfigError before any training when ``batch`` lacks what the policy loss of ``loss_config`` needs."""
    if batch.advantages is None:
        raise ConfigError("train_step: the batch has no advantages; call batch.with_advantages(...) first")
    if loss_config.use_kl_loss and batch.ref_log_probs is None:
        raise ConfigError(
            "use_kl_loss=True: the batch has no ref_log_probs; run compute_log_probs (on a trainer built with "
            "use_kl_loss, which loads the reference model) first"
        )
    if loss_config.use_tis and batch.rollout_log_probs is None:
        raise ConfigError(
            "use_tis=True: the samples carry no rollout log-probs; the engine must return them (or pass --no-use-tis)"
        )


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the torchrun-style environment (defaults 0, 1, 0)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


class TrainerBackend(ABC):
    """One rank of a trainer; see the module docstring for the full contract."""

    settings: TrainerSettings
    rank: int = 0
    world_size: int = 1
    model_path: str = ""

    @abstractmethod
    def init(self) -> dict[str, Any]: ...

    @abstractmethod
    def compute_log_probs(self, batch: TrainBatch, rollout_id: int = -1) -> LogProbResult: ...

    @abstractmethod
    def train_step(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]: ...

    @abstractmethod
    def iter_hf_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]: ...

    @abstractmethod
    def offload(self) -> None: ...

    @abstractmethod
    def onload(self) -> None: ...

    @abstractmethod
    def checkpoint_state(self, include_optimizer: bool) -> CheckpointState: ...

    @abstractmethod
    def load_checkpoint_state(self, state: CheckpointState, load_optimizer: bool = True) -> None: ...

    @abstractmethod
    def save_hf(self, out_dir: str) -> str: ...
