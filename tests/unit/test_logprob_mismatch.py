"""The trainer-engine log-prob mismatch metric: masked mean and max of |engine - trainer|, from a batch or
tallied over micro-batches and ranks."""

from __future__ import annotations

import torch

from raygym.algo.mismatch import MAX, MEAN, MismatchTally
from raygym.trainer.batch import TrainBatch, batch_mismatch
from raygym.types import Sample


def sample(rollout: list[float], mask: list[int] | None = None) -> Sample:
    s = Sample(prompt="", prompt_tokens=[3, 4], group_index=0, response_tokens=[5] * len(rollout), reward=1.0,
               rollout_log_probs=rollout)
    if mask is not None:
        s.loss_mask = mask
    return s


def test_batch_mismatch_is_masked_mean_and_max():
    batch = TrainBatch.from_samples([sample([-1.0, -2.0]), sample([-0.5, -4.0], mask=[1, 0])])
    batch = batch.with_log_probs({"log_probs": [torch.tensor([-1.2, -2.0]), torch.tensor([-0.1, -1.0])]})
    metrics = batch_mismatch(batch)
    assert abs(metrics[MEAN] - (0.2 + 0.0 + 0.4) / 3) < 1e-6  # the masked-out token (diff 3.0) is not counted
    assert abs(metrics[MAX] - 0.4) < 1e-6


def test_no_metric_without_both_log_probs():
    batch = TrainBatch.from_samples([sample([-1.0])])
    assert batch_mismatch(batch) == {}
    assert batch_mismatch(TrainBatch.from_samples([Sample(prompt="", prompt_tokens=[3], group_index=0,
                                                          response_tokens=[5], reward=0.0)])) == {}
    assert MismatchTally().metrics() == {}


def test_tally_over_micro_batches_equals_the_whole_batch():
    torch.manual_seed(0)
    engine, trainer = torch.randn(4, 6), torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    whole, parts = MismatchTally(), MismatchTally()
    whole.add(engine, trainer, mask)
    for rows in (slice(0, 1), slice(1, 4)):
        parts.add(engine[rows], trainer[rows], mask[rows])
    assert abs(whole.metrics()[MEAN] - parts.metrics()[MEAN]) < 1e-6 and whole.metrics()[MAX] == parts.metrics()[MAX]
    want = (engine - trainer).abs()[mask > 0]
    assert abs(whole.metrics()[MEAN] - float(want.mean())) < 1e-6 and whole.metrics()[MAX] == float(want.max())
