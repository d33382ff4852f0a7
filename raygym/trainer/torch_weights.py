"""How the torch backend's weights leave it: every HF tensor for weight sync (a tied one once), LoRA's adapters
alone as raygym's names and as PEFT's files, this rank's shards for raygym's checkpoints (and back) and the whole
model for an HF export.

``TorchWeights`` is mixed into :class:`raygym.trainer.torch_backend.TorchBackend`; it reads the backend's
``model``, ``optimizer``, ``schedule``, ``lora``, ``lora_targets``, ``model_path``, ``rank`` and ``world_size``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from raygym.checkpoint.state import CheckpointState

if TYPE_CHECKING:
    from raygym.lora import LoraSpec
    from raygym.trainer.optim import LrSchedule


def tied_aliases(model: torch.nn.Module) -> frozenset[str]:
    """Names of parameters that are another name's parameter (tied weights), all but the first of each.

    >>> m = torch.nn.Module(); m.a = torch.nn.Linear(2, 2); m.b = torch.nn.Linear(2, 2); m.b.weight = m.a.weight
    >>> sorted(tied_aliases(m))
    ['b.weight']
    """
    unique = {name for name, _ in model.named_parameters()}
    return frozenset(name for name, _ in model.named_parameters(remove_duplicate=False) if name not in unique)


class TorchWeights:
    """Weight sync, checkpoint and export of one torch-backend rank (see the module docstring)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LrSchedule
    lora: LoraSpec | None
    lora_targets: list[str]
    model_path: str
    rank: int
    world_size: int

    def iter_hf_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every weight by HF name, a tied one once under its first name (``model.embed_tokens.weight``, not
        ``lm_head.weight``): engines tie the head to the embedding too (raygym's server, SGLang's and vLLM's
        Qwen models; SGLang also loads the embedding into a separate head when it has one), and the Megatron
        backend sends it once; sending it twice only doubles an embedding's bytes on the wire."""
        if self.lora is not None:
            yield from self._iter_adapter_weights(dtype)
            return
        aliases = tied_aliases(self.model)
        for name, tensor in self.model.state_dict().items():
            if name in aliases:
                continue
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.rank != 0:
                yield name, None
                continue
            full = full.detach()
            yield name, full.to(dtype) if dtype is not None else full

    def _iter_adapter_weights(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """LoRA: the adapters only, under :mod:`raygym.lora`'s names (a collective under sharding)."""
        from raygym.trainer.lora import adapter_tensors

        for name, tensor in adapter_tensors(self.model):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if self.rank != 0:
                yield name, None
                continue
            full = full.detach()
            yield name, full.to(dtype) if dtype is not None else full

    def adapter_files(self) -> dict[str, bytes]:
        """LoRA: the adapter as PEFT's files (``adapter_config.json``, ``adapter_model.safetensors``) on rank 0,
        {} on the others (a collective under sharding)."""
        import json

        from safetensors.torch import save

        from raygym.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, peft_name

        assert self.lora is not None
        tensors = {peft_name(n): t.contiguous().cpu() for n, t in self._iter_adapter_weights(None) if t is not None}
        if self.rank != 0:
            return {}
        config = adapter_config(self.lora, self.model_path, self.lora_targets)
        return {ADAPTER_CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
                ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt"})}

    def checkpoint_state(self, include_optimizer: bool) -> CheckpointState:
        """This rank's shards: DTensors under FSDP2, plain tensors on one rank (see ``CheckpointState``)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from raygym.checkpoint.store import capture_rng_state

        if self.lora is not None:  # the adapters and their optimizer state, under raygym.lora's names
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            from raygym.lora import ADAPTER_DIR
            from raygym.trainer.lora import exported_name, rename_keys

            options = StateDictOptions(ignore_frozen_params=True)
            model = rename_keys(get_model_state_dict(self.model, options=options), exported_name)
            optim = (rename_keys(get_optimizer_state_dict(self.model, self.optimizer, options=options), exported_name)
                     if include_optimizer else None)
            files = {f"{ADAPTER_DIR}/{name}": data for name, data in self.adapter_files().items()}
            return CheckpointState(model=model, optimizer=optim, schedule=self.schedule.state_dict(),
                                   rng=capture_rng_state(), files=files)
        model = get_model_state_dict(self.model)
        optim = get_optimizer_state_dict(self.model, self.optimizer) if include_optimizer else None
        return CheckpointState(model=model, optimizer=optim, schedule=self.schedule.state_dict(),
                               rng=capture_rng_state())

    def load_checkpoint_state(self, state: CheckpointState, load_optimizer: bool = True) -> None:
        """Restore from ``state``: a ``checkpoint_state`` template that ``raygym.checkpoint.sharded`` filled."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from raygym.checkpoint.store import restore_rng_state

        if self.lora is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            from raygym.trainer.lora import in_memory_name, rename_keys

            options = StateDictOptions(ignore_frozen_params=True, strict=False)
            set_model_state_dict(self.model, rename_keys(state.model, in_memory_name), options=options)
            if load_optimizer and state.optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, rename_keys(state.optimizer, in_memory_name),
                                         options=options)
        else:
            set_model_state_dict(self.model, state.model)
            if load_optimizer and state.optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, state.optimizer)
        self.schedule.load_state_dict(state.schedule)
        restore_rng_state(state.rng)

    def save_hf(self, out_dir: str) -> str:
        """Rank 0 writes ``out_dir``: an HF model directory, or with LoRA the adapter (PEFT's directory format,
        ``peft.PeftModel.from_pretrained(base, out_dir)`` loads it) beside the tokenizer files."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.lora is not None:
            files = self.adapter_files()
            if self.rank == 0:
                from raygym.checkpoint.store import write_adapter_files

                write_adapter_files(files, self.model_path, out_dir)
            if self.world_size > 1:
                dist.barrier()
            return out_dir

        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            self._write_hf(cast("dict[str, torch.Tensor]", state), out_dir)
        if self.world_size > 1:
            dist.barrier()
        return out_dir

    def _write_hf(self, state: dict[str, torch.Tensor], out_dir: str) -> None:
        from raygym.checkpoint.store import write_hf_model

        write_hf_model(state, self.model_path, out_dir)
