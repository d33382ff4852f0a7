"""LoRA on the torch backend, with ``peft`` (``pip install 'raygym[lora]'``): the policy becomes the frozen base
model plus trainable adapters on the modules :class:`raygym.lora.LoraSpec` targets.

- The reference model for KL is the same model with the adapters switched off (:func:`adapters_disabled`):
  no second copy of the weights.
- Adapter tensors leave the trainer (weight sync, checkpoints, exports) under the names of
  :mod:`raygym.lora` (``<module path>.lora_A.weight``); peft's in-memory names carry its wrapper's prefix
  and the adapter's name (``base_model.model.<module path>.lora_A.default.weight``):
  :func:`exported_name` / :func:`in_memory_name` convert.

>>> exported_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
'model.layers.0.self_attn.q_proj.lora_A.weight'
>>> in_memory_name("model.layers.0.self_attn.q_proj.lora_A.weight")
'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from raygym.lora import PEFT_PREFIX, LoraSpec, import_peft, linear_modules, resolve_targets

PEFT_ADAPTER = "default"  # the name peft gives the one adapter it wraps a model with
def wrap_with_adapters(model: torch.nn.Module, spec: LoraSpec) -> tuple[torch.nn.Module, list[str]]:
    """``model`` with trainable LoRA adapters on the linear modules ``spec`` targets (every other weight frozen)
    and those modules' paths. Adapters start as peft initialises them: A random (the torch seed), B zero, so
    the wrapped model computes exactly what the base does."""
    peft = import_peft()
    targets = resolve_targets(spec, linear_modules(model))
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             bias="none")
    return peft.get_peft_model(model, config), targets


def exported_name(name: str) -> str:
    """The name an adapter tensor of peft's model travels and is stored under (see the module docstring)."""
    return name.removeprefix(PEFT_PREFIX).replace(f".{PEFT_ADAPTER}.", ".")


def in_memory_name(name: str) -> str:
    """peft's in-memory name of the adapter tensor ``name`` (the inverse of :func:`exported_name`)."""
    head, which, tail = name.rpartition(".lora_")
    if not head:
        raise ValueError(f"{name!r} is not a LoRA tensor name")
    kind, _, leaf = tail.partition(".")
    return f"{PEFT_PREFIX}{head}.lora_{kind}.{PEFT_ADAPTER}.{leaf}"


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(exported name, tensor)`` of every adapter weight of peft's ``model``: this rank's shard (a DTensor
    under FSDP2) or the whole tensor on one rank."""
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            yield exported_name(name), param


def adapters_disabled(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """Within it, peft's ``model`` computes as its base model: the KL reference without a second model."""
    return model.disable_adapter()  # type: ignore[operator,no-any-return]


def rename_keys(state: dict[str, Any], rename: Any) -> dict[str, Any]:
    """A model or optimizer state dict (``get_model_state_dict`` / ``get_optimizer_state_dict`` form) with every
    parameter name passed through ``rename``."""
    if "state" in state and "param_groups" in state:
        groups = [{**g, "params": [rename(p) for p in g["params"]]} for g in state["param_groups"]]
        return {"state": {rename(k): v for k, v in state["state"].items()}, "param_groups": groups}
    return {rename(k): v for k, v in state.items()}
