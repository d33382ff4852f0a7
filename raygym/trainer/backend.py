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
- ``iter_hf_weights(dtype=None)``: yields ``(hf_name, tensor)`` for every weight in HF naming; a
  collective under sharding: every rank must iterate; rank 0 gets full tensors, other ranks may get None.
- ``offload()`` / ``onload()``: move params, grads and optimizer state to host memory and back (colocate).
- ``checkpoint_state(include_optimizer) -> CheckpointState``: THIS rank's blocks of the weights (fp32,
  HF names and shapes), optimizer state, schedule position and RNG, for ``raygym.sharded_checkpoint`` (a
  collective under sharding; nothing is gathered). ``load_checkpoint_state(state, load_optimizer)``
  restores from such a state, once DCP has filled it in place.
- ``save_hf(out_dir)``: write an HF model directory (rank 0 writes; every rank calls).
- ``model_path``: the local HF directory of the policy's initial weights (config and tokenizer files).

Hooks ``custom_megatron_before_log_prob_hook`` / ``custom_megatron_before_train_step_hook`` (callable or
import path ``pkg.mod:fn``) are called as ``hook(args, rollout_id, batch)`` where ``args`` is the recipe
(or the ``TrainerSettings`` when no recipe was given), ``rollout_id`` the step (-1 when unknown) and
``batch`` the whole ``TrainBatch``; a hook that returns a ``TrainBatch`` replaces the batch.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from raygym.callables import load_callable
from raygym.errors import ConfigError
from raygym.trainer.contract import CheckpointState, LogProbResult, TrainMetrics


@dataclass
class TrainerSettings:
    """What a trainer backend needs, under the recipe's field names (see docs/internals.md)."""

    hf_checkpoint: str = ""
    ref_load: str = ""
    # optimizer
    lr: float = 5e-7
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None = every optimizer step of the run
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    optimizer: str = "adam"
    clip_grad: float = 1.0
    critic_lr: float | None = None
    # batching
    num_rollout: int = 1
    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 8
    global_batch_size: int = 16
    micro_batch_size: int = 1
    use_dynamic_batch_size: bool = True
    max_tokens_per_gpu: int = 8192
    balance_data: bool = False
    # algorithm
    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: float | None = None
    use_tis: bool = False
    tis_clip: float = 2.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = False
    gamma: float = 1.0
    lambd: float = 1.0
    rollout_temperature: float = 1.0
    # model
    freeze_params_name_list: list[str] | None = None
    recompute_granularity: str = "full"
    recompute_num_layers: int = 1
    # The recipe's recompute_* defaults target Megatron; the torch backend recomputes only when asked
    # (torch_recompute, from a recipe attribute or extra_config["torch_recompute"]).
    torch_recompute: bool = False
    seed: int = 1234
    dist_timeout_s: float = 600.0
    custom_megatron_before_log_prob_hook: Any = None
    custom_megatron_before_train_step_hook: Any = None
    recipe: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_recipe(cls, recipe: Any, model: Any = None, **overrides: Any) -> TrainerSettings:
        """Read every field by name from ``recipe`` (and ``hf_checkpoint`` from ``model``) when present."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name != "recipe" and hasattr(recipe, f.name):
                values[f.name] = getattr(recipe, f.name)
        extra = getattr(recipe, "extra_config", None) or {}
        if "torch_recompute" not in values and "torch_recompute" in extra:
            values["torch_recompute"] = bool(extra["torch_recompute"])
        if model is not None and getattr(model, "hf_checkpoint", None):
            values["hf_checkpoint"] = model.hf_checkpoint
        if not values.get("ref_load") and model is not None and getattr(model, "ref_checkpoint", None):
            values["ref_load"] = model.ref_checkpoint
        values.update(overrides)
        return cls(recipe=recipe, **values)

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> TrainerSettings:
        """From a ``TrainConfig`` (``cfg.recipe`` and ``cfg.model``)."""
        return cls.from_recipe(cfg.recipe, getattr(cfg, "model", None), **overrides)

    @property
    def hook_args(self) -> Any:
        return self.recipe if self.recipe is not None else self

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.kl_coef != 0.0

    def total_optimizer_steps(self) -> int:
        return max(
            1,
            self.num_rollout
            * (self.rollout_batch_size * self.n_samples_per_prompt)
            // self.global_batch_size,
        )


def call_hook(settings: TrainerSettings, field_name: str, rollout_id: int, batch: Any) -> Any:
    """Run the hook named by ``field_name`` if set; returns the (possibly replaced) batch."""
    hook = load_callable(getattr(settings, field_name), field_name)
    if hook is None:
        return batch
    result = hook(settings.hook_args, rollout_id, batch)
    return batch if result is None else result


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
    def compute_log_probs(self, batch: Any, rollout_id: int = -1) -> LogProbResult: ...

    @abstractmethod
    def train_step(self, batch: Any, rollout_id: int) -> TrainMetrics: ...

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
