"""LoRA adapters: what a run's adapters are, what their tensors are called and how they are stored. Pure at
import (torch, safetensors and transformers load inside the functions that need them).

- :class:`LoraSpec`: rank, alpha, dropout and target modules, from the recipe's ``lora_*`` fields.
- Names: an adapter tensor travels (weight sync, checkpoints) under its module's HF path plus
  ``.lora_A.weight`` / ``.lora_B.weight`` (``model.layers.0.self_attn.q_proj.lora_A.weight``), the name
  raygym's server gives the tensor it attaches to that module; PEFT's files hold the same name behind
  :data:`PEFT_PREFIX`.
- Files: PEFT's directory format (``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft``,
  vLLM's ``LoRARequest`` and SGLang's ``/load_lora_adapter`` read.

>>> spec = LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
>>> spec.scaling, peft_name("model.layers.0.self_attn.q_proj.lora_A.weight")
(2.0, 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight')
>>> resolve_targets(spec, ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
...                        "model.layers.0.self_attn.v_proj"])
['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.v_proj']
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from raygym.errors import ConfigError

if TYPE_CHECKING:
    import torch

ALL_LINEAR = "all-linear"  # every linear layer but the output head (PEFT's shorthand)
PEFT_PREFIX = "base_model.model."  # what PEFT puts before a module's path in its files
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_DIR = "adapter"  # where a checkpoint keeps its adapter (``iter_N/adapter/``)
ADAPTER_NAME = "raygym-policy"  # the name engines serve the run's adapter under (a request's ``lora_path``)
PEFT_VERSION = "0.21.2"  # the peft release raygym's LoRA is tested with (the ``lora`` extra pins it)
OUTPUT_HEADS = ("lm_head",)  # never targeted by all-linear (PEFT's rule: the output layer stays as it is)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


class LoraFields(Protocol):
    """The recipe fields that describe a run's adapters (a ``Recipe``, or a view that carries them)."""

    @property
    def lora_rank(self) -> int: ...
    @property
    def lora_alpha(self) -> int: ...
    @property
    def lora_dropout(self) -> float: ...
    @property
    def lora_target_modules(self) -> str: ...


@dataclass(frozen=True)
class LoraSpec:
    """The adapters a run trains: ``rank`` r, ``alpha`` (the update is scaled by ``alpha / rank``), dropout on
    the adapter's input while training, and the modules they attach to (``("all-linear",)`` or module names,
    matched against the end of each linear module's path as PEFT does)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_recipe(cls, recipe: LoraFields) -> LoraSpec | None:
        """The recipe's adapters (None when ``lora_rank`` is 0: full fine-tuning)."""
        if recipe.lora_rank <= 0:
            return None
        return cls(recipe.lora_rank, float(recipe.lora_alpha), float(recipe.lora_dropout),
                   parse_target_modules(recipe.lora_target_modules))

    def to_json(self) -> str:
        """The spec as one JSON object (what raygym's server takes as ``--lora-config``)."""
        return json.dumps({"r": self.rank, "lora_alpha": _number(self.alpha), "lora_dropout": self.dropout,
                           "target_modules": list(self.target_modules)}, sort_keys=True)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LoraSpec:
        """From a PEFT ``adapter_config.json`` (or :meth:`to_json`'s object); ConfigError for what raygym
        does not serve (DoRA, rsLoRA, per-module ranks, bias terms)."""
        for key, allowed in (("use_dora", (None, False)), ("use_rslora", (None, False)), ("bias", (None, "none")),
                             ("rank_pattern", (None, {})), ("alpha_pattern", (None, {})),
                             ("modules_to_save", (None, [])), ("fan_in_fan_out", (None, False))):
            if config.get(key) not in allowed:
                raise ConfigError(f"adapter config {key}={config.get(key)!r}: raygym serves plain LoRA adapters "
                                  f"only ({key} must be {allowed[-1]!r})")
        if config.get("peft_type", "LORA") != "LORA":
            raise ConfigError(f"adapter config peft_type={config.get('peft_type')!r}: raygym serves LORA adapters")
        targets = config.get("target_modules") or ()
        names = (targets,) if isinstance(targets, str) else tuple(targets)
        return cls(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout") or 0.0),
                   tuple(sorted(names)))


def _number(value: float) -> int | float:
    """An integral float as an int (PEFT's ``lora_alpha`` is an int in its files)."""
    return int(value) if float(value).is_integer() else value


def parse_target_modules(text: str) -> tuple[str, ...]:
    """``lora_target_modules`` as a tuple: ``"all-linear"`` or comma-separated module names.

    >>> parse_target_modules("q_proj, v_proj"), parse_target_modules("all-linear")
    (('q_proj', 'v_proj'), ('all-linear',))
    """
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ConfigError("lora_target_modules='': name the modules the adapters attach to, e.g. "
                          "--lora-target-modules all-linear or --lora-target-modules q_proj,v_proj")
    if ALL_LINEAR in names and len(names) > 1:
        raise ConfigError(f"lora_target_modules={text!r}: 'all-linear' already names every linear layer; give it "
                          "alone or list module names")
    bad = [n for n in names if n != ALL_LINEAR and not _NAME.match(n)]
    if bad:
        raise ConfigError(f"lora_target_modules={text!r}: {bad[0]!r} is not a module name; write names such as "
                          "q_proj,k_proj,v_proj separated by commas, or all-linear")
    return names


def resolve_targets(spec: LoraSpec, linear_modules: Iterable[str]) -> list[str]:
    """The paths of the linear modules ``spec`` attaches adapters to, among ``linear_modules`` (every linear
    module of the model); ConfigError naming a target that matches none of them."""
    paths = list(linear_modules)
    if spec.target_modules == (ALL_LINEAR,):
        chosen = [p for p in paths if p.rsplit(".", 1)[-1] not in OUTPUT_HEADS]
    else:
        chosen = [p for p in paths if any(p == t or p.endswith("." + t) for t in spec.target_modules)]
        suffixes = sorted({p.rsplit(".", 1)[-1] for p in paths})
        for target in spec.target_modules:
            if not any(p == target or p.endswith("." + target) for p in paths):
                raise ConfigError(
                    f"lora_target_modules: {target!r} is not a linear layer of this model; its linear layers are "
                    f"{', '.join(suffixes)} (or pass --lora-target-modules all-linear)")
    if not chosen:
        raise ConfigError("lora_target_modules: no linear layer of this model matches; pass "
                          "--lora-target-modules all-linear or names of its linear layers")
    return chosen


def linear_modules(model: torch.nn.Module) -> list[str]:
    """The paths of every ``torch.nn.Linear`` of ``model`` (raygym attaches adapters to linear layers only)."""
    import torch

    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def model_targets(model_path: str, spec: LoraSpec) -> list[str]:
    """The module paths ``spec`` targets in the HF model at ``model_path``, found on the meta device (no
    weights are read); ConfigError for an unknown target (what the run checks before Ray starts)."""
    import torch
    from transformers import AutoConfig

    from raygym.vision.qwen_vl import auto_model_class

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    return resolve_targets(spec, linear_modules(model))


def split_tensor_name(name: str) -> tuple[str, str]:
    """``(module path, "A" | "B")`` of an adapter tensor's name (with or without PEFT's prefix).

    >>> split_tensor_name("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight")
    ('model.layers.1.mlp.up_proj', 'B')
    """
    match = _TENSOR.match(name.removeprefix(PEFT_PREFIX))
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA tensor name (<module>.lora_A.weight or <module>.lora_B.weight)")
    return match["module"], match["which"]


def peft_name(name: str) -> str:
    """The name PEFT's files give the adapter tensor ``name``."""
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def adapter_config(spec: LoraSpec, base_model: str, targets: Iterable[str]) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for adapters of ``spec`` on ``targets`` (module paths) of ``base_model``.
    Target modules are written as the modules' own names (``q_proj``), which PEFT, vLLM and SGLang all match."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": _number(spec.alpha), "lora_dropout": spec.dropout,
        "target_modules": sorted({t.rsplit(".", 1)[-1] for t in targets}), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def write_adapter(directory: str | os.PathLike[str], config: Mapping[str, Any],
                  tensors: Mapping[str, torch.Tensor]) -> str:
    """Write a PEFT adapter directory (tensors under PEFT's names, contiguous CPU copies); files are written
    under temporary names and renamed, the weights first. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    weights = {peft_name(n): t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp{os.getpid()}"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    tmp = out / f".{ADAPTER_CONFIG}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / ADAPTER_CONFIG)
    return str(out)


def is_adapter_dir(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a PEFT adapter (its ``adapter_config.json``)."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def read_adapter(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, {tensor name: tensor})`` of a PEFT adapter directory, names without PEFT's prefix."""
    from safetensors.torch import load_file

    path = Path(directory)
    if not is_adapter_dir(path):
        raise ConfigError(f"adapter {str(path)!r}: no {ADAPTER_CONFIG} there; give a PEFT adapter directory")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    tensors = {name.removeprefix(PEFT_PREFIX): t for name, t in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    return config, tensors


def import_peft() -> Any:
    """The ``peft`` package, or a ConfigError naming the extra that installs it."""
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(f"lora_rank > 0 needs the peft package ({exc}); pip install 'raygym[lora]' "
                          f"(peft=={PEFT_VERSION}) where the trainers run, or set --lora-rank 0") from exc
    return peft
