"""raygym's server returns the experts its MoE routers chose (routing replay, :mod:`raygym.routed_experts`).

Started with ``--enable-return-routed-experts`` (SGLang's flag), the server puts a forward hook on every router
of its transformers model (``layers.{i}.mlp.gate``, which returns ``(logits, scores, indices)``) that keeps the
indices of the last forward pass. After each prefill and decode step the generation engine hands them to the
requests that asked (``return_routed_experts``) with :func:`record`: a prefill replaces a request's routes with
those of every token it forwarded (a re-prefill after a retract or a weight update recomputes them all), a
decode step appends the one token it forwarded. So an answer covers exactly the tokens its forward passes read,
prompt and output but the last, as stock SGLang's does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from raygym.engines.raygym_server.generation_request import GenerationRequest

_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RoutingCapture:
    """The router choices of the last forward pass of one model, per layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        config: Any = model.config
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(config.num_experts_per_tok)
        self._last: dict[int, torch.Tensor] = {}
        layers = []
        for name, module in model.named_modules():
            match = _ROUTER.search(name)
            if match is not None:
                layers.append(int(match.group(1)))
                module.register_forward_hook(self._hook(int(match.group(1))))
        if not layers:
            raise ValueError("--enable-return-routed-experts: the model has no MoE routers (layers.N.mlp.gate)")

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, tuple) or len(output) != 3:
                raise RuntimeError(f"router of layer {layer} ({type(module).__name__}) returned no top-k indices; "
                                   "routed experts need transformers >= 5 (its routers pick the top-k themselves)")
            self._last[layer] = output[2].detach()

        return hook

    def take(self, batch: int, width: int) -> torch.Tensor:
        """``[batch, width, layers, top_k]`` int32 on the CPU: the last forward pass's choices (a layer without
        a router, a dense one, reads 0, as SGLang's buffer does)."""
        out = torch.zeros(batch, width, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, ids in self._last.items():
            out[:, :, layer] = ids.reshape(batch, width, self.top_k).to("cpu", torch.int32)
        self._last.clear()
        return out


def record(capture: RoutingCapture | None, rows: Sequence[GenerationRequest], width: int, prefill: bool) -> None:
    """Hand the last forward pass (``rows`` left-padded to ``width`` tokens; a decode step: ``width`` 1) to the
    rows that asked for their routed experts."""
    if capture is None or not any(r.return_routed_experts for r in rows):
        return
    taken = capture.take(len(rows), width)
    for r, ids in zip(rows, taken, strict=True):
        if not r.return_routed_experts:
            continue
        if prefill:
            r.routed_experts = [ids[width - (len(r.input_ids) + len(r.output_ids)):].clone()]
        else:
            r.routed_experts.append(ids.clone())


def answer_routes(r: GenerationRequest) -> torch.Tensor:
    """``[forwarded tokens, layers, top_k]`` int32 of a finished request (no rows when it was never forwarded)."""
    if not r.routed_experts:
        return torch.zeros(0, dtype=torch.int32)
    return torch.cat(r.routed_experts)
