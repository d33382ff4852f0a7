"""``TrainBatch``: what the driver sends to trainers, one entry per sample, in rollout order.

Per sample: ``tokens`` (prompt + response, 1-D int64), ``prompt_lengths``, ``response_lengths``,
``loss_masks`` (float, one per response token), ``rewards``, and the optional per-response-token
tensors ``advantages``, ``rollout_log_probs``, ``old_log_probs``, ``ref_log_probs``, ``returns``, ``values``.

>>> from raygym.types import Sample
>>> s = Sample(prompt="a", prompt_tokens=[3, 4], group_index=0, response_tokens=[5], reward=1.0,
...            rollout_log_probs=[-0.5])
>>> b = TrainBatch.from_samples([s, s])
>>> len(b), b.total_lengths(), b.tokens[0].tolist()
(2, [3, 3], [3, 4, 5])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from raygym.algo.advantages import compute_advantages
from raygym.algo.batching import balance_across_ranks, contiguous_shard
from raygym.algo.mismatch import MismatchTally

PER_SAMPLE_TENSOR_FIELDS = (
    "advantages",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "returns",
    "values",
)


@dataclass
class TrainBatch:
    """Samples prepared for training; every list has one entry per sample."""

    tokens: list[torch.Tensor]
    prompt_lengths: list[int]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rewards: list[float] = field(default_factory=list)
    group_size: int = 1
    advantages: list[torch.Tensor] | None = None
    rollout_log_probs: list[torch.Tensor] | None = None
    old_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    # fully asynchronous runs: how many policy versions older than the trainer each response token's engine was,
    # for the log-prob mismatch split by staleness (ages 0 .. age_buckets - 1; older ones fold into the last)
    token_ages: list[torch.Tensor] | None = None
    age_buckets: int = 0
    # MoE routing replay: per sample the experts the engine routed each forwarded token to, flattened
    # [tokens - 1, layers * top_k] rows as 1-D int16 (raygym/routed_experts.py); empty for a sample without them
    routed_experts: list[torch.Tensor] | None = None
    # vision-language samples: each sample's images as PNG data URLs (raygym/vision/images.py), [] for a text
    # sample; None when no sample has one
    images: list[list[str]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_samples(cls, samples: Sequence, group_size: int | None = None) -> TrainBatch:
        """Build from ``raygym.types.Sample`` records (groups contiguous).

        ``group_size`` defaults to the size of the first group (samples sharing ``group_index``).
        Rollout log-probs are kept only when every sample has one per response token.
        """
        tokens, plens, rlens, masks, rewards, rollout = [], [], [], [], [], []
        for s in samples:
            tokens.append(torch.tensor(list(s.prompt_tokens) + list(s.response_tokens), dtype=torch.int64))
            plens.append(len(s.prompt_tokens))
            rlens.append(len(s.response_tokens))
            mask = s.effective_loss_mask()
            if len(mask) != len(s.response_tokens):
                raise ValueError(
                    f"sample {len(tokens) - 1}: loss_mask has {len(mask)} entries for {len(s.response_tokens)} response tokens"
                )
            masks.append(torch.tensor(mask, dtype=torch.float32))
            rewards.append(float(s.reward) if s.reward is not None else 0.0)
            rollout.append(torch.tensor(s.rollout_log_probs, dtype=torch.float32))
        if group_size is None:
            first = samples[0].group_index if samples else 0
            group_size = next((i for i, s in enumerate(samples) if s.group_index != first), len(samples)) or 1
        has_rollout = all(len(r) == n for r, n in zip(rollout, rlens, strict=True)) and len(samples) > 0
        routed = None
        if any(s.routed_experts is not None for s in samples):
            routed = [torch.empty(0, dtype=torch.int16) if s.routed_experts is None
                      else torch.tensor(s.routed_experts.reshape(-1), dtype=torch.int16) for s in samples]
        images = [list(s.images) for s in samples] if any(s.images for s in samples) else None
        return cls(
            tokens,
            plens,
            rlens,
            masks,
            rewards,
            group_size,
            rollout_log_probs=rollout if has_rollout else None,
            routed_experts=routed,
            images=images,
        )

    def total_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths, strict=True)]

    def num_loss_tokens(self) -> int:
        """Trained tokens (sum of loss masks): the per-token loss denominator."""
        return int(sum(float(m.sum()) for m in self.loss_masks))

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """A new batch with the samples at ``indices`` in that order (tensors shared, not copied)."""
        idx = list(indices)
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                changes[f.name] = [value[i] for i in idx] if (f.name != "rewards" or value) else []
        return replace(self, **changes)

    def shard_indices(self, rank: int, world: int, balance: bool = False) -> list[int]:
        """Indices of rank ``rank``'s samples: token-balanced equal counts or contiguous blocks."""
        if balance and world > 1:
            return balance_across_ranks(self.total_lengths(), world)[rank]
        return contiguous_shard(len(self), rank, world)

    def shard(self, rank: int, world: int, balance: bool = False) -> TrainBatch:
        """Rank ``rank``'s share of the batch (``balance`` = the ``balance_data`` field)."""
        return self.select(self.shard_indices(rank, world, balance))

    def with_token_ages(self, ages: Sequence[Sequence[int]], buckets: int) -> TrainBatch:
        """Copy carrying each response token's age (``ages``: per sample, per response token)."""
        return replace(self, token_ages=[torch.tensor(list(a), dtype=torch.int64) for a in ages], age_buckets=buckets)

    def with_log_probs(self, result: Mapping[str, list[torch.Tensor]]) -> TrainBatch:
        """Copy with ``old_log_probs`` / ``ref_log_probs`` / ``values`` from ``compute_log_probs``'s result."""
        changes: dict[str, Any] = {}
        for key, name in (
            ("log_probs", "old_log_probs"),
            ("ref_log_probs", "ref_log_probs"),
            ("values", "values"),
        ):
            if key in result:
                changes[name] = result[key]
        return replace(self, **changes)

    def with_advantages(
        self, estimator: str, *, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0
    ) -> TrainBatch:
        """Copy with ``advantages`` and ``returns`` from ``raygym.algo.compute_advantages``."""
        out = compute_advantages(
            estimator,
            torch.tensor(self.rewards, dtype=torch.float32),
            self.group_size,
            response_masks=self.loss_masks,
            log_probs=self.old_log_probs,
            ref_log_probs=self.ref_log_probs,
            values=self.values,
            kl_coef=kl_coef,
            gamma=gamma,
            lambd=lambd,
        )
        return replace(self, advantages=out.advantages, returns=out.returns)


def batch_mismatch(batch: TrainBatch) -> dict[str, float]:
    """The metrics of a ``TrainBatch`` that carries both rollout and old log-probs (else ``{}``); split by
    token age when the batch carries ``token_ages``."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        return {}
    tally = MismatchTally(batch.age_buckets if batch.token_ages is not None else 0)
    tally.add_rows(batch.rollout_log_probs, batch.old_log_probs, batch.loss_masks, batch.token_ages)
    return tally.metrics()
