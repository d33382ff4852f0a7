"""``TensorShard``: one rank's rectangular block of a bigger ("global") tensor, in the form that
``torch.distributed.checkpoint`` (DCP) saves and loads with resharding.

FSDP2 state dicts are DTensors, which DCP already understands. Megatron's tensor-parallel shards are not
rectangular blocks of the HF tensors in general (a fused QKV shard holds rows of three HF tensors, the
vocabulary is padded), so the Megatron backend cuts every local parameter into one block per HF tensor
(``raygym.trainer.weight_mapping.hf_blocks``) and hands each block to DCP as a ``TensorShard``.
DCP writes the block at its offsets; loading, it copies into the block whatever part of it the saved
chunks cover, whatever the world size that wrote them. Replicas (data-parallel ranks, replicated norms)
declare the same block and DCP keeps one copy.

The class implements the checkpointing hooks that DTensor implements (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) and nothing else: any tensor operation on it raises.

>>> import torch
>>> shard = TensorShard(torch.ones(2, 3), offsets=(4, 0), global_shape=(8, 3))
>>> tuple(shard.shape), shard.local.shape, shard.offsets
((8, 3), torch.Size([2, 3]), torch.Size([4, 0]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class TensorShard(torch.Tensor):
    """``local`` placed at ``offsets`` inside a tensor of ``global_shape`` (see the module docstring)."""

    local: torch.Tensor
    offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]) -> TensorShard:
        if len(offsets) != local.dim() or len(global_shape) != local.dim():
            raise ValueError(f"offsets {tuple(offsets)} / global shape {tuple(global_shape)} do not match a "
                             f"{local.dim()}-d block")
        if any(o < 0 or o + n > g for o, n, g in zip(offsets, local.shape, global_shape, strict=True)):
            raise ValueError(f"block {tuple(local.shape)} at {tuple(offsets)} exceeds {tuple(global_shape)}")
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=local.dtype, device=local.device)
        r.local = local
        r.offsets = torch.Size(offsets)
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"TensorShard(local={tuple(self.local.shape)}, offsets={tuple(self.offsets)}, global={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares a plain function; subclasses use a classmethod
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"TensorShard is a checkpoint container; {func} is not supported on it")

    # ---- the hooks torch.distributed.checkpoint calls (as it does on DTensor) ----
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(self.local), size=self.shape
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local
