"""What a checkpoint holds of one trainer rank, in the layout both trainer backends share (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CheckpointState:
    """One rank's share of a checkpoint, in the layout both backends share: HF tensor names and HF shapes,
    each tensor this rank's block of it (a DTensor under FSDP2, a ``TensorShard`` on Megatron, a plain
    tensor when the rank holds all of it). ``raygym.checkpoint.sharded`` saves it with
    ``torch.distributed.checkpoint`` (each rank writes its own blocks) and loads into it in place.

    ``model``: HF name -> weights in fp32 (the master copy where there is one).
    ``optimizer``: ``{"state": {HF name: {"step", "exp_avg", "exp_avg_sq", ...}}, ...}`` (Adam moments in the
    parameter's HF shape), or None when not saved/loaded.
    ``schedule``: the LR-schedule position (``{"step": optimizer steps taken}``).
    ``rng``: this rank's RNG states (``raygym.checkpoint.store.capture_rng_state``).
    ``files``: files rank 0 writes into the checkpoint directory beside the weights (relative path -> bytes),
    e.g. a LoRA run's adapter in PEFT's format under ``adapter/``; empty elsewhere.
    """

    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    schedule: dict[str, int] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
