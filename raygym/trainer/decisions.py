"""What the trainer backends decide from their settings before they train: the torch backend's compute
dtype, the CPU cores and threads of a rank, and whether the separate old-log-prob pass can be skipped."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from raygym.cluster.cpu_threads import dedicate_torch_threads, pin_process, split_cores
from raygym.errors import ConfigError
from raygym.trainer.backend import TrainerSettings


def reuses_current_log_probs(s: TrainerSettings) -> bool:
    """Whether the separate old-log-prob forward pass is redundant: with one optimizer step per rollout
    the old (pre-update) policy IS the current one, so ``old_log_probs == current log-probs.detach()``
    (ratio 1) — provided nothing else needs them before training: no KL loss or reward KL (reference
    pass), no PPO critic, no log-prob hook.

    TIS does not need the pass either: its weights compare the trainer's policy before the update (the
    detached current log-probs, the same numbers the pass would compute) with the engine's log-probs, the
    behaviour policy of samples made by older weights (decoupled PPO). That pass was fully asynchronous
    training's extra forward over every sample.

    >>> from raygym.config import ModelConfig, Recipe, TrainConfig
    >>> def settings(**fields):
    ...     cfg = TrainConfig(recipe=Recipe(actor_num_gpus_per_node=1, **fields), model=ModelConfig(hf_checkpoint="m"))
    ...     return TrainerSettings.from_config(cfg)
    >>> reuses_current_log_probs(settings(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8))
    True
    >>> reuses_current_log_probs(settings(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4))
    False
    """
    return (
        s.global_batch_size == s.rollout_batch_size * s.n_samples_per_prompt
        and not s.use_kl_loss
        and s.kl_coef == 0.0
        and s.advantage_estimator != "ppo"
        and not s.use_critic
        and not s.custom_megatron_before_log_prob_hook
    )


def cpu_training_cores(cores: Sequence[int], local_rank: int, local_ranks: int, busy_cores: int,
                       placement: str) -> tuple[int, ...] | None:
    """The cores a CPU trainer rank is pinned to when engines decode beside it (``busy_cores`` > 0) and
    ``cpu_placement`` is ``"disjoint"``: its slice of :func:`raygym.cluster.cpu_threads.split_cores`, the
    engines keeping the last cores. None: not pinned (no overlap, ``"shared"``, or too few cores).

    >>> cpu_training_cores([0, 1], 0, 1, busy_cores=1, placement="disjoint")
    (0,)
    >>> cpu_training_cores([0, 1], 0, 1, busy_cores=0, placement="disjoint") is None
    True
    """
    if placement != "disjoint" or busy_cores == 0:
        return None
    split = split_cores(cores, busy_cores, local_ranks)
    return None if split is None else split.trainer[local_rank]


def set_cpu_training_cores(s: TrainerSettings, local_rank: int, local_ranks: int) -> int:
    """Give the calling thread of a CPU trainer rank its cores and torch threads (its helper threads run serially:
    :func:`raygym.cluster.cpu_threads.dedicate_torch_threads`); returns the thread count. ``local_ranks``: the
    node's trainer ranks of this role."""
    cores = sorted(os.sched_getaffinity(0))
    if s.use_critic:  # the critic's ranks train beside the policy's: both share the cores, unpinned
        return dedicate_torch_threads(cpu_training_threads(len(cores), 2 * local_ranks, s.engine_threads))
    pinned = cpu_training_cores(cores, local_rank, local_ranks, s.engine_threads, s.cpu_placement)
    if pinned is None:
        return dedicate_torch_threads(cpu_training_threads(len(cores), local_ranks, s.engine_threads))
    pin_process(pinned)
    return dedicate_torch_threads(len(pinned))


def cpu_training_threads(cores: int, local_ranks: int, busy_cores: int = 0) -> int:
    """Torch intra-op threads of one CPU trainer rank: the node's cores, less ``busy_cores`` (the
    threads of engines that decode at the same time, i.e. in ``async_mode``), shared by its ranks. Ray
    starts actors with ``OMP_NUM_THREADS=1``, which leaves the other cores idle during a train step.
    Measured on 2 cores (raygym/bench/e2e.py, 2.6M model, async): 1 trainer thread beside the engine's
    one gives 0.93-1.01 s per step, 2 threads 1.06-1.10 s (threads that lose their core stall the others).

    >>> cpu_training_threads(2, 1), cpu_training_threads(16, 4), cpu_training_threads(2, 4)
    (2, 4, 1)
    >>> cpu_training_threads(2, 1, busy_cores=1), cpu_training_threads(16, 2, busy_cores=4)
    (1, 6)
    """
    return max(1, (cores - busy_cores) // max(1, local_ranks))


def compute_dtype(dtype: str, *, cuda: bool) -> torch.dtype:
    """The torch backend's compute dtype for ``model.dtype`` (weights stay float32): ``auto`` is bfloat16 on
    a GPU and float32 on CPU; float16 (no loss scaling here) and half precision on CPU are ConfigErrors.

    >>> compute_dtype("auto", cuda=True), compute_dtype("auto", cuda=False), compute_dtype("float32", cuda=True)
    (torch.bfloat16, torch.float32, torch.float32)
    """
    if dtype == "float16":
        raise ConfigError(
            "dtype='float16': the torch backend has no loss scaling, which float16 training needs; use "
            "dtype='bfloat16' (or the megatron backend)"
        )
    if dtype == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if dtype == "bfloat16" and not cuda:
        raise ConfigError(
            "dtype='bfloat16': the torch backend computes in float32 on CPU; set dtype='auto' or 'float32', "
            "or train on a GPU"
        )
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Dropout makes train-mode log-probs differ from the eval-mode pass, so they cannot stand in for it."""
    config = getattr(model, "config", None)
    if any(float(getattr(config, name, 0.0) or 0.0) > 0.0 for name in ("attention_dropout", "hidden_dropout")):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0.0 for m in model.modules())
