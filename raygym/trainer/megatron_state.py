"""The Megatron backend's side of a sharded checkpoint: its local parameters and their optimizer state as
blocks of the HF tensors (``raygym.trainer.weight_mapping.hf_blocks``), so that a checkpoint is the same
whatever the tensor/expert/data-parallel layout that wrote it and loads into any other.

Each local parameter contributes, per HF tensor it holds a part of, one block: a plain tensor when the
block is the whole HF tensor (replicated tensors, TP=1), else a :class:`TensorShard`. The weights saved
are the fp32 master weights (Megatron's optimizer keeps them apart from bf16 parameters on a GPU; in CPU
mode the parameters are fp32 themselves).

>>> # state = megatron_checkpoint_state(local_params, optimizer, shape, include_optimizer=True)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from raygym.checkpoint.tensor_shard import TensorShard
from raygym.errors import ConfigError
from raygym.trainer.weight_mapping import ModelShape, ParamMap, hf_blocks, join_hf_blocks, split_hf_blocks

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class LocalParam:
    """One parameter of this rank with its HF mapping and the tensor-parallel coordinates of its shard
    (the expert-tensor-parallel ones for experts)."""

    pm: ParamMap
    param: torch.nn.Parameter
    tp_rank: int
    tp_size: int


def _blocks(lp: LocalParam, tensor: torch.Tensor, shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF name -> this rank's block of it, cut from ``tensor`` (the parameter or a same-shaped state)."""
    out: dict[str, torch.Tensor] = {}
    blocks = hf_blocks(lp.pm, tensor.shape, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size)
    pieces = split_hf_blocks(lp.pm, tensor, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size)
    for block, piece in zip(blocks, pieces, strict=True):
        piece = piece.detach().contiguous()
        whole = block.sizes == block.global_shape
        out[block.hf_name] = piece if whole else TensorShard(piece, block.offsets, block.global_shape)
    return out


def _joined(lp: LocalParam, entries: dict[str, Any], shape: ModelShape) -> torch.Tensor:
    """The local tensor of ``lp`` from its blocks in ``entries`` (HF name -> block, as ``_blocks`` made)."""
    blocks = hf_blocks(lp.pm, lp.param.shape, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size)
    pieces = []
    for block in blocks:
        entry = entries[block.hf_name]
        pieces.append(entry.local if isinstance(entry, TensorShard) else entry)
    return join_hf_blocks(lp.pm, pieces, lp.param.shape, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size)


def optimizer_slots(optimizer: Any) -> dict[int, tuple[torch.Tensor, Any]]:
    """``id(model parameter) -> (its master parameter, the torch optimizer that holds its state)``.

    A torch optimizer (CPU mode) steps the parameters themselves; Megatron's mixed-precision optimizer
    keeps fp32 copies of bf16/fp16 parameters; its distributed optimizer shards the state over
    data-parallel ranks in flat buffers, which this layout does not cover (ConfigError)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return {id(p): (p, optimizer) for g in optimizer.param_groups for p in g["params"]}
    slots: dict[int, tuple[torch.Tensor, Any]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(opt).__name__ == "DistributedOptimizer":
            raise ConfigError(
                "use_distributed_optimizer=True: raygym's sharded checkpoints do not cover Megatron's distributed "
                "optimizer state; set use_distributed_optimizer=False, or no_save_optim=True (weights only)"
            )
        inner = opt.optimizer
        if hasattr(opt, "float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                for model_param, main_param in zip(model_group, main_group, strict=True):
                    slots[id(model_param)] = (main_param, inner)
            for group in opt.fp32_from_fp32_groups:
                for p in group:
                    slots[id(p)] = (p, inner)
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    slots[id(p)] = (p, inner)
    return slots


def _moments(master: torch.Tensor, inner: Any) -> dict[str, torch.Tensor]:
    """The Adam state of ``master``; zeros (and step 0, which is what a fresh optimizer has) before the
    first step, so that a template exists to load into."""
    state = inner.state.get(master)
    if state:
        return {k: v for k, v in state.items() if torch.is_tensor(v)}
    return {"step": torch.zeros((), dtype=torch.float32), **{k: torch.zeros_like(master) for k in ADAM_MOMENTS}}


def megatron_checkpoint_state(
    params: Iterable[LocalParam], optimizer: Any, shape: ModelShape, *, include_optimizer: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(model blocks, optimizer {"state": {HF name: {step, exp_avg, exp_avg_sq}}} or None)`` of this rank."""
    slots = optimizer_slots(optimizer)
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for lp in params:
        master, inner = slots.get(id(lp.param), (lp.param, None))
        model.update(_blocks(lp, master.float(), shape))
        if not include_optimizer or inner is None:
            continue  # frozen: no optimizer state
        for key, value in _moments(master, inner).items():
            if value.shape == master.shape:
                for hf_name, block in _blocks(lp, value, shape).items():
                    optim_state.setdefault(hf_name, {})[key] = block
            else:  # a scalar such as Adam's step: the same value for every HF tensor of the parameter
                for hf_block in hf_blocks(lp.pm, master.shape, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size):
                    optim_state.setdefault(hf_block.hf_name, {})[key] = value.detach().clone()
    return model, ({"state": optim_state} if include_optimizer else None)


def load_megatron_checkpoint_state(
    params: Iterable[LocalParam], optimizer: Any, shape: ModelShape, model: dict[str, Any],
    optim: dict[str, Any] | None,
) -> None:
    """Write blocks filled by ``torch.distributed.checkpoint`` back into the parameters, their master copies
    and (``optim`` not None) the optimizer state."""
    slots = optimizer_slots(optimizer)
    for lp in params:
        master, inner = slots.get(id(lp.param), (lp.param, None))
        value = _joined(lp, model, shape)
        with torch.no_grad():
            lp.param.copy_(value.to(lp.param.dtype))
            if master is not lp.param:
                master.copy_(value.to(master.dtype))
        if optim is None or inner is None:
            continue
        first = hf_blocks(lp.pm, master.shape, shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size)
        if not first:
            continue
        saved = optim["state"][first[0].hf_name]
        state: dict[str, torch.Tensor] = {}
        for key, entry in saved.items():
            if isinstance(entry, TensorShard) or entry.shape != torch.Size([]):
                per_name = {b.hf_name: optim["state"][b.hf_name][key] for b in first}
                state[key] = _joined(lp, per_name, shape).to(master.device, master.dtype)
            else:
                state[key] = entry.clone()
        inner.state[master] = state
