"""LoRA adapters on raygym's server: each targeted ``nn.Linear`` gets two child modules, ``lora_A`` (r x in) and
``lora_B`` (out x r), and a forward hook that adds ``lora_B(lora_A(x)) * alpha / r`` to the layer's output.

The adapters are applied beside the base weights, never merged into them, so the base stays bit-exact whatever
the adapters do (an exact un-merge would need the pre-merge weights kept anyway), and the adapter tensors are
parameters of the model under their own names (``model.layers.0.self_attn.q_proj.lora_A.weight``, the names of
:mod:`raygym.lora`): weight sync writes, checksums, delta-encodes, receives in place and double-buffers them like
any weight. What the hook costs per generated token is measured by ``raygym/bench/lora.py``.

>>> import torch
>>> from raygym.lora import LoraSpec
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> attach_adapters(model, LoraSpec(rank=2, alpha=4, dropout=0.0, target_modules=("all-linear",)))
['0']
>>> sorted(n for n, _ in model.named_parameters())
['0.bias', '0.lora_A.weight', '0.lora_B.weight', '0.weight']
"""

from __future__ import annotations

import math
from typing import Any

import torch

from raygym.errors import ConfigError
from raygym.lora import LoraSpec, linear_modules, read_adapter, resolve_targets, split_tensor_name

SCALING = "lora_scaling"  # the attribute of an adapted layer holding alpha / r


def _add_adapter(module: torch.nn.Module, x: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    lora_a, lora_b = module.get_submodule("lora_A"), module.get_submodule("lora_B")
    return output + lora_b(lora_a(x[0])) * float(getattr(module, SCALING))


def attach_adapters(model: torch.nn.Module, spec: LoraSpec) -> list[str]:
    """Give the linear modules ``spec`` targets adapters (A as peft initialises it, from the torch seed; B zero,
    so the model computes what it did) on the model's device and dtype; returns their paths."""
    targets = resolve_targets(spec, linear_modules(model))
    modules = dict(model.named_modules())
    for path in targets:
        layer = modules[path]
        assert isinstance(layer, torch.nn.Linear), path
        if hasattr(layer, "lora_A"):
            raise ConfigError(f"{path}: already has an adapter; attach adapters once")
        kind = {"device": layer.weight.device, "dtype": layer.weight.dtype}
        layer.lora_A = torch.nn.Linear(layer.in_features, spec.rank, bias=False, **kind)
        layer.lora_B = torch.nn.Linear(spec.rank, layer.out_features, bias=False, **kind)
        torch.nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(layer.lora_B.weight)
        layer.lora_A.requires_grad_(False)
        layer.lora_B.requires_grad_(False)
        setattr(layer, SCALING, spec.scaling)
        layer.register_forward_hook(_add_adapter)
    return targets


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The names of the adapter tensors ``model`` carries (empty without adapters)."""
    return [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def load_adapter(model: torch.nn.Module, directory: str) -> LoraSpec:
    """Attach the adapters of the PEFT directory ``directory`` to ``model`` and copy their tensors in (every
    tensor of the file must fit a targeted module, and every targeted module must get both); returns its spec."""
    config, tensors = read_adapter(directory)
    spec = LoraSpec.from_config(config)
    targets = set(attach_adapters(model, spec))
    params = dict(model.named_parameters())
    for name, tensor in tensors.items():
        module, _ = split_tensor_name(name)
        if module not in targets or name not in params:
            raise ConfigError(f"adapter {directory!r}: {name!r} belongs to no module this model targets "
                              f"({len(targets)} targeted); is it an adapter of this base model?")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ConfigError(f"adapter {directory!r}: {name} is {tuple(tensor.shape)}, the model's is "
                              f"{tuple(params[name].shape)}")
    missing = sorted(set(adapter_names(model)) - set(tensors))
    if missing:
        raise ConfigError(f"adapter {directory!r}: has no tensor for {missing[:3]}; is it complete?")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    return spec
