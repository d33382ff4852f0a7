"""What the trainer tests share: a random batch over the builtin tokenizer's characters, trainer
settings sized for the tiny model, and the environment of one rank of a local torch.distributed world."""

from __future__ import annotations

import os
import random
import socket

import torch

from raygym.trainer import TrainBatch, TrainerSettings
from raygym.types import Sample

VOCAB_LOW, VOCAB_HIGH = 2, 40  # real character ids of the builtin tokenizer


def make_batch(seed: int = 0, groups: int = 2, group_size: int = 4) -> TrainBatch:
    """Random prompts/responses with rewards in [0, 1]; one sample per group has untrained middle tokens
    (a multi-turn-like sample: tokens the policy did not produce)."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(3, 8))]
        for j in range(group_size):
            response = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(2, 14))]
            mask = [1] * len(response)
            if j == 1 and len(response) >= 4:
                mask[1:3] = [0, 0]
            samples.append(
                Sample(prompt="p", prompt_tokens=prompt, group_index=g, sample_index=j,
                       response_tokens=response, loss_mask=mask, reward=float(rng.random()))
            )
    return TrainBatch.from_samples(samples)


def settings_for(path: str, **overrides) -> TrainerSettings:
    """Settings for the tiny model: 8 samples per optimizer step, micro-batches of at most 48 tokens."""
    base = dict(hf_checkpoint=path, lr=1e-3, weight_decay=0.0, global_batch_size=8, max_tokens_per_gpu=48,
                use_dynamic_batch_size=True, clip_grad=1.0, seed=7)
    return TrainerSettings(**{**base, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_world(rank: int, world: int, port: int) -> None:
    """The torchrun environment of ``rank`` (one thread, so two ranks share 2 cores fairly)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
