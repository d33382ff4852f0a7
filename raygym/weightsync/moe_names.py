"""MoE expert weights under the names each engine kind loads, converted at the sender (pure torch).

A Qwen3-MoE checkpoint stores one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
``down_proj``); transformers 5 fuses them in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``: every
expert's gate rows then its up rows; ``mlp.experts.down_proj`` ``[E, H, I]``). The torch backend trains the
in-memory module, so it yields the fused names; the Megatron backend yields the checkpoint's per-expert names.

What each engine kind takes (:data:`EXPERT_LAYOUT`):

* ``sglang`` and ``vllm``: the checkpoint's per-expert names: their models' ``load_weights`` map those onto
  their own fused, sharded parameters (a fused name is no name they know).
* ``raygym``: its server holds the transformers model, so its parameters are the fused in-memory tensors;
  sending those keeps the per-tensor checksum exact (a fused tensor is verified as the one tensor it is).

:func:`for_engine` rewrites a stream of ``(name, tensor)`` into the kind's layout, tensor by tensor where it
splits and one layer's experts at a time where it fuses; every other name passes unchanged.

>>> import torch
>>> fused = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # E=2, I=2, H=3
>>> out = dict(split_fused("model.layers.0.mlp.experts.gate_up_proj", fused))
>>> sorted(out)[:2], out["model.layers.0.mlp.experts.1.up_proj.weight"].tolist()
(['model.layers.0.mlp.experts.0.gate_proj.weight', 'model.layers.0.mlp.experts.0.up_proj.weight'], [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0]])
>>> down = torch.ones(2, 3, 2)  # [E, H, I]
>>> per_expert = list(for_engine([("model.layers.0.mlp.experts.gate_up_proj", fused),
...                               ("model.layers.0.mlp.experts.down_proj", down)], "sglang"))
>>> len(per_expert), per_expert[-1][0]
(6, 'model.layers.0.mlp.experts.1.down_proj.weight')
>>> back = dict(for_engine(per_expert, "raygym"))
>>> torch.equal(back["model.layers.0.mlp.experts.gate_up_proj"], fused), torch.equal(back["model.layers.0.mlp.experts.down_proj"], down)
(True, True)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

PER_EXPERT = "per_expert"
FUSED = "fused"
# engine kind -> the expert layout its loader takes (see the module docstring)
EXPERT_LAYOUT = {"raygym": FUSED, "sglang": PER_EXPERT, "vllm": PER_EXPERT}

_FUSED_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def split_fused(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert checkpoint tensors of one fused in-memory tensor (``gate_up_proj`` or ``down_proj``);
    each is a contiguous copy, so a bucket may hold it without keeping the fused tensor alive."""
    match = _FUSED_RE.match(name)
    assert match is not None, name
    prefix = match["prefix"]
    if match["kind"] == "down_proj":
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", tensor[e].contiguous()
        return
    half = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half].contiguous()
        yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:].contiguous()


def fuse_experts(prefix: str, experts: dict[int, dict[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The fused in-memory tensors of one layer's experts (``experts[e][proj]``, every expert 0..E-1 with all
    three projections)."""
    count = len(experts)
    if sorted(experts) != list(range(count)) or any(len(p) != 3 for p in experts.values()):
        have = {e: sorted(p) for e, p in sorted(experts.items())}
        raise ValueError(f"{prefix}: incomplete experts to fuse {have}; every expert needs gate, up and down")
    gate_up = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(count)])
    down = torch.stack([experts[e]["down_proj"] for e in range(count)])
    return [(f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)]


def for_engine(weights: Iterable[tuple[str, torch.Tensor]], kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every MoE expert tensor in the layout engine kind ``kind`` loads (module docstring).

    Fusing holds one layer's experts until a tensor of another module arrives (both backends yield a layer's
    experts together), so at most one layer's experts are buffered."""
    layout = EXPERT_LAYOUT[kind]
    pending_prefix: str | None = None
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if layout == PER_EXPERT:
            if _FUSED_RE.match(name):
                yield from split_fused(name, tensor)
            else:
                yield name, tensor
            continue
        match = _EXPERT_RE.match(name)
        if match is None:
            if pending_prefix is not None:
                yield from fuse_experts(pending_prefix, pending)
                pending_prefix, pending = None, {}
            yield name, tensor
            continue
        if pending_prefix is not None and match["prefix"] != pending_prefix:
            yield from fuse_experts(pending_prefix, pending)
            pending = {}
        pending_prefix = match["prefix"]
        pending.setdefault(int(match["expert"]), {})[match["proj"]] = tensor
    if pending_prefix is not None:
        yield from fuse_experts(pending_prefix, pending)
