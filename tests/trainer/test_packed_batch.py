"""``PackedBatch``: the TrainBatch the driver ships to trainer actors survives packing unchanged."""

from __future__ import annotations

import pickle

import torch
from test_torch_backend import make_batch

from raygym.trainer.actor import PackedBatch, unpacked


def test_pack_round_trip_keeps_every_field():
    batch = make_batch(seed=2, groups=3, group_size=4).with_advantages("grpo")
    batch = batch.with_log_probs({"log_probs": [torch.randn(n) for n in batch.response_lengths]})
    packed = PackedBatch.pack(batch)
    # per-sample tensors travel as one flat buffer per field
    assert set(packed.columns) == {"tokens", "loss_masks", "advantages", "returns", "old_log_probs"}
    back = unpacked(pickle.loads(pickle.dumps(packed)))
    assert back.prompt_lengths == batch.prompt_lengths and back.response_lengths == batch.response_lengths
    assert back.rewards == batch.rewards and back.group_size == batch.group_size
    assert back.ref_log_probs is None and back.rollout_log_probs is None and back.values is None
    for name in packed.columns:
        ours, theirs = getattr(back, name), getattr(batch, name)
        assert len(ours) == len(theirs) == len(batch)
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_plain_batch_passes_through():
    batch = make_batch(seed=4)
    assert unpacked(batch) is batch
