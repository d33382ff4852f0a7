"""The weight endpoints of raygym's server: HTTP, ordering and memory state around
:class:`raygym.engines.serving.weight_receiver.WeightReceiver`, which does the work.

Requests of one weight-update group are received in arrival order (a sender may post bucket k+1 while
bucket k still loads) on one thread and loaded in the same order on another, so bucket k+1 comes off the
wire while bucket k is applied; a busy engine never stalls the sender; loading takes the model between
two decode steps (or after the running batch when generation is not paused, as SGLang does).

Double-buffered updates (``/raygym/shadow_begin``, the usual update routes, ``/raygym/weights_checksum``
with ``shadow: true``, ``/raygym/shadow_switch``) load into a shadow copy without taking the model, so
generation goes on; the switch takes the model between two decode steps only for the swap.

Names: the model's own ``state_dict()`` names (what a trainer holding the same HF class sends). A vision-language
model's are not its checkpoint's (transformers renames on load: ``model.language_model.*`` and
``model.visual.*`` in memory, ``model.*`` and ``visual.*`` in ``model.safetensors``); :class:`ServerWeightReceiver`
takes both (:func:`checkpoint_aliases`), so ``/update_weights_from_disk`` of a saved checkpoint, a trainer's
in-memory names, ``/get_weights_by_name`` and checksums by either name land on the same tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web
from pydantic import ValidationError

from raygym.engine_api import protocol
from raygym.engine_api.protocol import Endpoint
from raygym.engines.raygym_server.generation import GenerationEngine
from raygym.engines.serving.http import (
    BadRequest,
    handles_errors,
    parse,
    read_json,
    register_routes,
    result_response,
)
from raygym.engines.serving.weight_receiver import Loader, WeightReceiver

# A vision-language model's in-memory prefixes and its checkpoint's (transformers' Qwen2-VL family renaming).
CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Checkpoint name -> the model's own ``state_dict()`` name, for the names that differ: a vision-language
    model's language-model and vision-tower weights (empty for other models, whose names are the checkpoint's).

    >>> from raygym.builtin.tiny_vlm import build_tiny_vlm
    >>> aliases = checkpoint_aliases(build_tiny_vlm(0)[0])
    >>> aliases["model.layers.0.mlp.up_proj.weight"], aliases["visual.merger.ln_q.weight"]
    ('model.language_model.layers.0.mlp.up_proj.weight', 'model.visual.merger.ln_q.weight')
    """
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return {}
    aliases: dict[str, str] = {}
    for name in model.state_dict():
        for inner, outer in CHECKPOINT_PREFIXES:
            if name.startswith(inner):
                aliases[outer + name[len(inner):]] = name
                break
    return aliases


class ServerWeightReceiver(WeightReceiver):
    """:class:`WeightReceiver` that also takes the checkpoint's names of a model whose in-memory names differ
    (:func:`checkpoint_aliases`): loaders see the model's own names. Buckets sent whole (``flattened_bucket``,
    received in place) are applied by the model's own names only."""

    def __init__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self.aliases = checkpoint_aliases(model)

    def own_name(self, name: str) -> str:
        """The model's ``state_dict()`` name of ``name`` (a checkpoint name, or already the model's)."""
        return self.aliases.get(name, name)

    def resolve_loader(self, load_format: str | None) -> Loader:
        fn = super().resolve_loader(load_format)
        if not self.aliases:
            return fn

        def renamed(model: torch.nn.Module, named_tensors: Any) -> Any:
            return fn(model, ((self.own_name(name), tensor) for name, tensor in named_tensors))

        return renamed

    def weights_checksum(self, **body: Any) -> dict[str, Any]:
        names = body.get("names")
        if not self.aliases or not names:
            return super().weights_checksum(**body)
        answer = super().weights_checksum(**{**body, "names": [self.own_name(n) for n in names]})
        sums = answer["checksums"]
        return {**answer, "checksums": {n: sums[self.own_name(n)] for n in names}}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return super().get_weights_by_name(self.own_name(name), truncate_size)


class WeightRoutes:
    """Weight loading, groups, sessions and checksums for one :class:`GenerationEngine`."""

    def __init__(self, engine: GenerationEngine, receiver: WeightReceiver, released: Callable[[], set[str]]) -> None:
        self.engine = engine
        self.receiver = receiver
        self._released = released

    def register(self, router: web.UrlDispatcher) -> None:
        routes: dict[Endpoint, Callable[[web.Request], Any]] = {
            Endpoint.UPDATE_WEIGHTS_FROM_DISK: self.update_weights_from_disk,
            Endpoint.UPDATE_WEIGHTS_FROM_TENSOR: self.update_weights_from_tensor,
            Endpoint.INIT_WEIGHTS_UPDATE_GROUP: self.init_weights_update_group,
            Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED: self.update_weights_from_distributed,
            Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP: self.destroy_weights_update_group,
            Endpoint.BEGIN_WEIGHT_UPDATE: self.begin_weight_update,
            Endpoint.END_WEIGHT_UPDATE: self.end_weight_update,
            Endpoint.UPDATE_WEIGHT_VERSION: self.update_weight_version,
            Endpoint.RAYGYM_WEIGHTS_CHECKSUM: self.weights_checksum,
            Endpoint.RAYGYM_SHADOW_BEGIN: self.shadow_begin,
            Endpoint.RAYGYM_SHADOW_SWITCH: self.shadow_switch,
            Endpoint.RAYGYM_SHADOW_DISCARD: self.shadow_discard,
        }
        routes[Endpoint.GET_WEIGHTS_BY_NAME] = self.get_weights_by_name
        register_routes(router, routes)

    @property
    def weight_version(self) -> str:
        return self.receiver.weight_version

    def _require_weights_resident(self) -> None:
        if "weights" in self._released():
            raise BadRequest("weights are released; call /resume_memory_occupation with tags ['weights'] first")

    def _abort_first(self, req: Any) -> None:
        if req.abort_all_requests:
            self.engine.abort(abort_all=True, message="aborted for a weight update")

    @handles_errors
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromDisk)
        self._require_weights_resident()
        self._abort_first(req)
        return result_response(await asyncio.to_thread(self.receiver.update_weights_from_disk, **req.model_dump()))

    @handles_errors
    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromTensor)
        self._require_weights_resident()
        self._abort_first(req)
        return result_response(await asyncio.to_thread(self.receiver.update_weights_from_tensor, **req.model_dump()))

    @handles_errors
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.InitWeightsUpdateGroup)
        return result_response(await asyncio.to_thread(self.receiver.init_weights_update_group, **req.model_dump()))

    @handles_errors
    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromDistributed)
        if req.group_name not in self.receiver.groups:
            raise BadRequest(f"group_name={req.group_name!r}: no such group; call /init_weights_update_group first")
        self.receiver.resolve_loader(None if req.load_format == protocol.FLATTENED_BUCKET else req.load_format)
        self._require_weights_resident()
        self._abort_first(req)
        # Submitted in arrival order (no await between here and the submit): received and loaded in that order.
        answer = self.receiver.submit_distributed(**req.model_dump())
        return result_response(await asyncio.wrap_future(answer))

    @handles_errors
    async def shadow_begin(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.ShadowBegin, required=False)
        self._require_weights_resident()
        return result_response(await asyncio.to_thread(self.receiver.shadow_begin, **req.model_dump()))

    @handles_errors
    async def shadow_switch(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.ShadowSwitch, required=False)
        self._require_weights_resident()
        if req.abort_all_requests:
            self.engine.abort(abort_all=True, message="aborted for a weight version switch")
        # The swap only exchanges storage: take the model between two decode steps, never wait for the batch.
        answer = await asyncio.to_thread(self.receiver.shadow_switch, hold=lambda: self.engine.exclusive(wait_idle=False),
                                         **req.model_dump())
        return result_response(answer)

    @handles_errors
    async def shadow_discard(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        return result_response(self.receiver.shadow_discard())

    @handles_errors
    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.DestroyWeightsUpdateGroup, required=False)
        return result_response(await asyncio.to_thread(self.receiver.destroy_weights_update_group, **req.model_dump()))

    @handles_errors
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.BeginWeightUpdate, required=False)
        return result_response(self.receiver.begin_weight_update(**req.model_dump()))

    @handles_errors
    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        return result_response(self.receiver.end_weight_update())

    @handles_errors
    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightVersion)
        if req.abort_all_requests:
            self.engine.abort(abort_all=True, message="aborted for a weight version update")
        self.receiver.weight_version = req.new_version
        return web.json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                                  "new_version": req.new_version})

    @handles_errors
    async def weights_checksum(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.WeightsChecksum, required=False)
        self._require_weights_resident()
        try:
            return web.json_response(await asyncio.to_thread(self.receiver.weights_checksum, **req.model_dump()))
        except ValueError as exc:  # WeightSyncError is a RuntimeError; unknown names are the caller's
            raise BadRequest(str(exc)) from None
        except RuntimeError as exc:
            raise BadRequest(str(exc)) from None

    @handles_errors
    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False) if request.method == "POST" else dict(request.query)
        try:
            name = str(body["name"])
            truncate = int(body.get("truncate_size", 100))
        except (KeyError, TypeError, ValueError, ValidationError):
            raise BadRequest("get_weights_by_name: send 'name' (an HF parameter name) and optionally 'truncate_size'") from None
        self._require_weights_resident()
        return web.json_response(await asyncio.to_thread(self.receiver.get_weights_by_name, name, truncate))
