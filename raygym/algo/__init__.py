"""Pure torch RL maths (no Ray): advantages, KL estimators, losses and batch planning."""

from raygym.algo.advantages import (
    ESTIMATORS,
    AdvantageOutput,
    compute_advantages,
    gae,
    group_advantages,
    masked_whiten,
)
from raygym.algo.batching import (
    balance_across_ranks,
    contiguous_shard,
    fixed_micro_batches,
    num_optimizer_steps,
    optimizer_step_slices,
    pack_micro_batches,
    padded_micro_batches,
)
from raygym.algo.kl import KL_KINDS, kl_penalty
from raygym.algo.losses import (
    aggregate,
    entropy_from_logits,
    importance_weights,
    kl_loss,
    policy_loss,
    sequence_log_ratio,
    tis_weights,
    value_loss,
)
from raygym.algo.rl_loss import RLLossConfig, ratio_level_for, rl_loss

__all__ = [
    "ESTIMATORS",
    "KL_KINDS",
    "RLLossConfig",
    "AdvantageOutput",
    "aggregate",
    "balance_across_ranks",
    "compute_advantages",
    "contiguous_shard",
    "entropy_from_logits",
    "fixed_micro_batches",
    "gae",
    "group_advantages",
    "importance_weights",
    "kl_loss",
    "kl_penalty",
    "masked_whiten",
    "num_optimizer_steps",
    "optimizer_step_slices",
    "pack_micro_batches",
    "padded_micro_batches",
    "policy_loss",
    "ratio_level_for",
    "rl_loss",
    "sequence_log_ratio",
    "tis_weights",
    "value_loss",
]
