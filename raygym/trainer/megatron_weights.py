"""How the Megatron backend moves weights between its sharded ``GPTModel`` and HF names and shapes: loading
an HF checkpoint into this rank's shards, the full HF tensors for weight sync and export (gathered over
the tensor- and expert-parallel groups), and the per-parameter HF mapping its checkpoints use.

``MegatronWeights`` is mixed into :class:`raygym.trainer.megatron_backend.MegatronBackend`; it reads the
backend's ``shape``, ``facts``, ``model`` and ``model_path``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raygym.errors import ConfigError, RaygymError
from raygym.trainer.megatron_model import safetensors_index, unwrap
from raygym.trainer.megatron_state import LocalParam
from raygym.trainer.weight_mapping import (
    ModelShape,
    expert_offset,
    hf_to_megatron,
    layer_offset,
    megatron_to_hf,
    param_maps_by_name,
    to_global_name,
)


class MegatronWeights:
    """HF <-> Megatron weight movement of one Megatron rank (see the module docstring)."""

    shape: ModelShape | None
    facts: dict[str, int]
    model: Any
    model_path: str
    rank: int

    # ---- weights ------------------------------------------------------------------------------
    def _offsets(self) -> tuple[int, int]:
        assert self.shape is not None
        from megatron.core import parallel_state as ps

        lo = layer_offset(self.shape.num_layers, ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
        eo = expert_offset(self.shape.num_experts, self.facts["ep_rank"], self.facts["ep_size"])
        return lo, eo

    def _local_params(self, model: Any) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
        """(local name, global name, param) for every trained tensor of this rank."""
        lo, eo = self._offsets()
        for name, param in unwrap(model).named_parameters():
            yield name, to_global_name(name, lo, eo), param

    def _tp_coordinates(self, is_expert: bool) -> tuple[int, int]:
        """(rank, size) of the tensor-parallel group that splits a parameter (the expert TP group for experts)."""
        if not is_expert:
            return self.facts["tp_rank"], self.facts["tp_size"]
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()

    def _mapped_params(self, model: Any) -> list[LocalParam]:
        assert self.shape is not None
        maps = param_maps_by_name(self.shape)
        out = []
        for _local, global_name, param in self._local_params(model):
            pm = maps.get(global_name)
            if pm is None:
                raise RaygymError(f"megatron parameter {global_name} has no HF mapping in weight_mapping.py")
            out.append(LocalParam(pm, param, *self._tp_coordinates(pm.expert is not None)))
        return out

    def load_hf_checkpoint(self, model: Any, checkpoint_dir: str) -> None:
        """Copy this rank's shard of every HF tensor into ``model`` (bit for bit, then cast to the model dtype)."""
        from safetensors import safe_open

        assert self.shape is not None
        where = safetensors_index(checkpoint_dir)
        handles: dict[str, Any] = {}
        try:
            for lp in self._mapped_params(model):
                tensors = []
                for hf_name in lp.pm.hf:
                    if hf_name not in where:
                        raise ConfigError(f"hf_checkpoint={checkpoint_dir!r}: tensor {hf_name} is missing")
                    f = where[hf_name]
                    handles.setdefault(f, safe_open(f, "pt"))
                    tensors.append(handles[f].get_tensor(hf_name))
                shard = hf_to_megatron(lp.pm, tensors, self.shape, tp_rank=lp.tp_rank, tp_size=lp.tp_size,
                                       padded_vocab_size=self.shape.padded_vocab_size(self.facts["tp_size"]))
                if tuple(shard.shape) != tuple(lp.param.shape):
                    raise RaygymError(f"{lp.pm.megatron}: HF shard shape {tuple(shard.shape)} != model {tuple(lp.param.shape)}")
                with torch.no_grad():
                    lp.param.copy_(shard.to(lp.param.dtype))
        finally:
            handles.clear()

    def iter_hf_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight; a collective: every rank of the trainer must iterate.

        TP shards are all-gathered over the TP group and experts over the EP group, so every rank gets
        full tensors: CPU copies (never views of the live parameters), in ``dtype`` or the model's dtype.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.shape is not None
        maps = param_maps_by_name(self.shape)
        tp_group = ps.get_tensor_model_parallel_group()
        tp_size = self.facts["tp_size"]
        ep_size = self.facts["ep_size"]
        for local_name, global_name, param in self._local_params(self.model):
            pm = maps[global_name]
            local = param.detach()
            if ep_size > 1 and pm.expert is not None:
                yield from self._gathered_experts(local_name, pm, local, dtype)
                continue
            shards = [local]
            if pm.expert is not None:  # experts are split over the expert tensor-parallel group (size 1 in raygym)
                _, split = self._tp_coordinates(is_expert=True)
                group = ps.get_expert_tensor_parallel_group()
            else:
                split, group = tp_size, tp_group
            if pm.tp_dim is not None and split > 1:
                shards = [torch.empty_like(local) for _ in range(split)]
                dist.all_gather(shards, local.contiguous(), group=group)
            for hf_name, tensor in megatron_to_hf(pm, shards, self.shape):
                yield hf_name, tensor.to("cpu", dtype or tensor.dtype, copy=True)  # never alias live params

    def _gathered_experts(self, local_name: str, pm: Any, local: torch.Tensor, dtype: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """One local expert parameter of every EP rank (global experts ``e + k * experts_per_rank``)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.shape is not None
        ep_size = self.facts["ep_size"]
        _, etp_size = self._tp_coordinates(is_expert=True)
        maps = param_maps_by_name(self.shape)
        per_rank = self.shape.num_experts // ep_size
        tp_shards = [local]
        if pm.tp_dim is not None and etp_size > 1:
            tp_shards = [torch.empty_like(local) for _ in range(etp_size)]
            dist.all_gather(tp_shards, local.contiguous(), group=ps.get_expert_tensor_parallel_group())
        stacked = torch.stack(tp_shards)
        everyone = [torch.empty_like(stacked) for _ in range(ep_size)]
        dist.all_gather(everyone, stacked, group=ps.get_expert_model_parallel_group())
        lo, _ = self._offsets()
        for ep_rank, shards in enumerate(everyone):
            gname = to_global_name(local_name, lo, ep_rank * per_rank)
            for hf_name, tensor in megatron_to_hf(maps[gname], list(shards), self.shape):
                yield hf_name, tensor.to("cpu", dtype or tensor.dtype, copy=True)  # never alias live params

    def save_hf(self, out_dir: str) -> str:
        """Write an HF model directory (config, tokenizer files, one safetensors file); rank 0 writes."""
        from safetensors.torch import save_file

        state = {name: t.contiguous() for name, t in self.iter_hf_weights()}
        if self.rank != 0:
            return out_dir
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        for f in Path(self.model_path).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
        return str(out)
