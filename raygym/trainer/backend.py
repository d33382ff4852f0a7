"""The trainer backend interface (``TrainerBackend``) and the settings every backend reads.

A backend owns one data-parallel rank of the policy (or critic) model. ``TrainerActor`` picks one by
``recipe.trainer_backend`` and forwards to it; the torch backend (``torch_backend.py``) and the Megatron
backend (``megatron_backend.py``) implement this contract:

- ``init() -> dict``: load the HF checkpoint, build optimizer and schedule, join the torch.distributed
  world (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``); returns facts (rank, world, params).
- ``compute_log_probs(batch) -> dict[str, list[Tensor]]``: for EVERY sample of ``batch`` (each rank gets
  the whole batch, computes its share, and the results are gathered so every rank returns the same):
  ``"log_probs"`` (policy), ``"ref_log_probs"`` when a reference model is used, ``"entropy"`` when asked,
  ``"values"`` for a critic. 1-D float32 CPU tensors, one per response token. Logits are divided by
  ``rollout_temperature`` before the log-softmax, as the rollout engine does.
- ``train_step(batch, rollout_id) -> dict[str, float]``: one rollout's training. Every rank receives the
  whole batch; it is cut into ``len(batch) // global_batch_size`` optimizer steps of consecutive samples,
  each step's samples are spread over ranks, packed into micro-batches and accumulated. Metrics are
  reduced over ranks (identical on every rank).
- ``iter_hf_weights(dtype=None)``: yields ``(hf_name, tensor)`` for every weight in HF naming; a
  collective under sharding: every rank must iterate; rank 0 gets full tensors, other ranks may get None.
- ``offload()`` / ``onload()``: move params, grads and optimizer state to host memory and back (colocate).
- ``checkpoint_state(include_optimizer) -> dict | None`` / ``load_checkpoint_state(state, load_optimizer)``:
  full (unsharded, HF-named) state on rank 0 (None elsewhere) for ``raygym.checkpoint``.
- ``save_hf(out_dir)``: write an HF model directory (rank 0 writes; every rank calls).

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

from raygym.config import load_callable


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

    @abstractmethod
    def init(self) -> dict[str, Any]: ...

    @abstractmethod
    def compute_log_probs(self, batch: Any, rollout_id: int = -1) -> dict[str, list]: ...

    @abstractmethod
    def train_step(self, batch: Any, rollout_id: int) -> dict[str, float]: ...

    @abstractmethod
    def iter_hf_weights(self, dtype: Any = None) -> Iterator[tuple[str, Any]]: ...

    @abstractmethod
    def offload(self) -> None: ...

    @abstractmethod
    def onload(self) -> None: ...

    @abstractmethod
    def checkpoint_state(self, include_optimizer: bool) -> dict[str, Any] | None: ...

    @abstractmethod
    def load_checkpoint_state(self, state: dict[str, Any] | None, load_optimizer: bool) -> None: ...

    @abstractmethod
    def save_hf(self, out_dir: str) -> str: ...
