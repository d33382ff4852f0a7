"""Routing replay ("R3") in the trainers' forward passes: every MoE router of OUR forward pass uses the experts
the rollout engine routed each token to, instead of choosing its own.

Routers choose top-k experts by comparing scores; the engine's and the trainer's scores differ in the last bits
(kernels, precision, batch shapes), so close scores flip and a token goes through other experts in training than
in generation. Replay forces the engine's experts; the gate weights are still the trainer's own probabilities of
those experts (softmax over all experts, renormalised over the chosen ones as the model does), so the router
keeps its gradient.

A sample's routes (``TrainBatch.routed_experts``, :mod:`raygym.routed_experts`) cover its forwarded tokens
(prompt and response but the last token). :func:`token_routes` lays a micro-batch's routes out in the token order
the routers see: ``[layers, tokens, top_k]`` long, ``-1`` where a token has none (the last token, padding, a
sample without routes), whose router then chooses as usual (their outputs reach no log-prob).

* torch backend (transformers' Qwen3-MoE): :class:`HFRoutingReplay` puts a forward hook on each layer's router
  (``mlp.gate``, a ``TopKRouter`` returning ``(logits, scores, indices)``) that replaces its choice.
* Megatron backend: :class:`MegatronRoutingReplay` sets each ``TopKRouter``'s ``router_replay`` (megatron-core's
  hook around its top-k, ``get_replay_topk``) to an object of ours that reads the same layout.

Both keep the routes of the last micro-batch until the next one is set, so activation recomputation in backward
replays them too, and both tally how often the router's own choice differed from the engine's
(:meth:`RouteTally.metrics`).

>>> routes = token_routes([torch.tensor([1, 2, 3, 0], dtype=torch.int16)], offsets=[1], total=4,
...                       num_layers=2, top_k=1)
>>> routes[:, :, 0].tolist()  # sample of 3 tokens at offset 1: its 2 forwarded tokens have routes
[[-1, 1, 3, -1], [-1, 2, 0, -1]]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from raygym.errors import ConfigError, RaygymError

_HF_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_MEGATRON_ROUTER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.mlp\.router$")


def token_routes(routed: Sequence[torch.Tensor] | None, offsets: Sequence[int], total: int, num_layers: int,
                 top_k: int) -> torch.Tensor:
    """``[num_layers, total, top_k]`` long: sample i's routes (1-D, ``[rows, num_layers * top_k]`` flattened)
    from token position ``offsets[i]`` on, -1 elsewhere."""
    out = torch.full((num_layers, total, top_k), -1, dtype=torch.long)
    for flat, start in zip(routed or [], offsets, strict=False):
        if flat.numel() == 0:
            continue
        if flat.numel() % (num_layers * top_k):
            raise RaygymError(f"routed experts of {flat.numel()} ids do not split into rows of {num_layers} layers x "
                              f"top-{top_k}: did they come from another model?")
        rows = flat.reshape(-1, num_layers, top_k).to(torch.long)
        if start + rows.shape[0] > total:
            raise RaygymError(f"routed experts for {rows.shape[0]} tokens at position {start} overrun the "
                              f"{total}-token micro-batch")
        out[:, start : start + rows.shape[0]] = rows.permute(1, 0, 2)
    return out


class RouteTally:
    """Counts, over replayed tokens, how often the router's own top-k set differed from the forced one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.tokens = 0  # replayed tokens (each counted once per forward pass)
        self.tokens_differing = 0  # of them, those whose own choice differed in at least one layer
        self.decisions = 0  # replayed (token, layer) pairs
        self.decisions_differing = 0
        self._forward_any: torch.Tensor | None = None  # per token of the current forward: any layer differed

    def add(self, own: torch.Tensor, forced: torch.Tensor, replayed: torch.Tensor, first_layer: bool) -> None:
        """One router's choice ``own`` vs ``forced`` (``[N, k]``) on tokens ``replayed`` (``[N]`` bool)."""
        differs = (own.sort(-1).values != forced.sort(-1).values).any(-1) & replayed
        self.decisions += int(replayed.sum())
        self.decisions_differing += int(differs.sum())
        if first_layer or self._forward_any is None or self._forward_any.shape != differs.shape:
            self._close_forward()
            self._forward_any = torch.zeros_like(differs)
            self.tokens += int(replayed.sum())
        self._forward_any |= differs

    def _close_forward(self) -> None:
        if self._forward_any is not None:
            self.tokens_differing += int(self._forward_any.sum())
            self._forward_any = None

    def metrics(self, prefix: str = "train") -> dict[str, float]:
        """``<prefix>/routing_replay_*``: replayed tokens, and the shares of tokens (any layer) and of router
        decisions whose own choice differed from the engine's; then starts counting afresh."""
        self._close_forward()
        out = {f"{prefix}/routing_replay_tokens": float(self.tokens),
               f"{prefix}/routing_replay_differ_token_frac": self.tokens_differing / max(self.tokens, 1),
               f"{prefix}/routing_replay_differ_decision_frac": self.decisions_differing / max(self.decisions, 1)}
        self._reset()
        return out


def _replayed(own_idx: torch.Tensor, forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices to use, which tokens are replayed): ``forced`` where it has routes, ``own_idx`` elsewhere."""
    if forced.shape[0] != own_idx.shape[0] or forced.shape[1] != own_idx.shape[1]:
        raise RaygymError(f"routing replay: the router sees {tuple(own_idx.shape)} choices, the replayed routes "
                          f"are {tuple(forced.shape)}; the token layout of the forward pass and of the routes differ")
    forced = forced.to(own_idx.device)
    have = forced[:, 0] >= 0
    return torch.where(have[:, None], forced.to(own_idx.dtype), own_idx), have


class HFRoutingReplay:
    """Forward hooks on the routers of a transformers Qwen3-MoE model (see the module docstring).

    :meth:`use` sets the routes of the next forward passes (``None``: routers choose); without routers (a dense
    model) it is a no-op.
    """

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        self.enabled = enabled
        self.tally = RouteTally()
        self.routers: dict[int, torch.nn.Module] = {}
        self.top_k = 0
        self._routes: torch.Tensor | None = None
        if not enabled:
            return
        for name, module in model.named_modules():
            match = _HF_ROUTER.search(name)
            if match is None:
                continue
            if not hasattr(module, "top_k"):
                raise ConfigError(
                    f"use_rollout_routing_replay=True: the router {name} ({type(module).__name__}) does not pick its "
                    "top-k itself (transformers before 5 do it in the MoE block); upgrade transformers to >= 5")
            self.routers[int(match.group(1))] = module
            self.top_k = int(module.top_k)
            module.register_forward_hook(self._hook(int(match.group(1))))
        if not self.routers:
            raise ConfigError("use_rollout_routing_replay=True: the model has no MoE routers to replay; use it with "
                              "a mixture-of-experts model (e.g. Qwen3-MoE) or drop --use-rollout-routing-replay")
        config: Any = model.config
        self.num_layers = int(config.num_hidden_layers)  # rows hold every layer (a dense one's ids unused)

    def metrics(self) -> dict[str, float]:
        """The tally's ``train/routing_replay_*`` figures since the last call (none when replay is off)."""
        return self.tally.metrics() if self.enabled else {}

    def use(self, routed: Sequence[torch.Tensor] | None, lengths: Sequence[int] = (), width: int = 0) -> None:
        """Routes of right-padded ``[len(lengths), width]`` batches from now on (``routed`` None: routers choose)."""
        if not self.enabled or routed is None:
            self._routes = None
            return
        self._routes = token_routes(routed, [i * width for i in range(len(lengths))], len(lengths) * width,
                                    self.num_layers, self.top_k)

    def _hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._routes is None:
                return None
            logits, _scores, own = output
            index, have = _replayed(own, self._routes[layer])
            self.tally.add(own, index, have, first_layer=layer == min(self.routers))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
            if getattr(module, "norm_topk_prob", False):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), index

        return hook


class _MegatronLayerReplay:
    """What megatron-core's router calls around its top-k (the ``RouterReplay`` interface)."""

    def __init__(self, owner: MegatronRoutingReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Callable[..., Any] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups, group_topk)
        routes = self.owner.routes
        if routes is None:
            return values, own
        index, have = _replayed(own, routes[self.layer])
        self.owner.tally.add(own, index, have, first_layer=self.layer == self.owner.first_layer)
        return scores.gather(1, index), index


class MegatronRoutingReplay:
    """Replay in a Megatron ``GPTModel``: each MoE layer's ``TopKRouter.router_replay`` is ours."""

    def __init__(self, model: torch.nn.Module, enabled: bool, num_layers: int, top_k: int) -> None:
        self.tally = RouteTally()
        self.routes: torch.Tensor | None = None
        self.num_layers, self.top_k = num_layers, top_k
        self.first_layer = -1
        self.enabled = enabled
        if not enabled:
            return
        layers = []
        for name, module in model.named_modules():
            match = _MEGATRON_ROUTER.search(name)
            if match is not None and hasattr(module, "router_replay"):
                module.router_replay = _MegatronLayerReplay(self, int(match.group(1)))
                layers.append(int(match.group(1)))
        if not layers:
            raise ConfigError("use_rollout_routing_replay=True: the model has no MoE routers to replay; use it with "
                              "a mixture-of-experts model (e.g. Qwen3-MoE) or drop --use-rollout-routing-replay")
        self.first_layer = min(layers)

    def metrics(self) -> dict[str, float]:
        """The tally's ``train/routing_replay_*`` figures since the last call (none when replay is off)."""
        return self.tally.metrics() if self.enabled else {}

    def use(self, routed: Sequence[torch.Tensor] | None, starts: Sequence[int] = (), total: int = 0,
            local: tuple[int, int] | None = None) -> None:
        """Routes of a packed ``[1, total]`` row (samples at ``starts``) from now on; ``local`` = (first token,
        count) this rank's routers see (sequence parallel splits the row over the tensor-parallel ranks)."""
        if not self.enabled or routed is None:
            self.routes = None
            return
        routes = token_routes(routed, starts, total, self.num_layers, self.top_k)
        if local is not None:
            routes = routes[:, local[0] : local[0] + local[1]]
        self.routes = routes
