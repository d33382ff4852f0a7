"""SGLang's LoRA routes on raygym's server: ``/load_lora_adapter`` {``lora_name``, ``lora_path``} loads a PEFT
adapter directory into the model's adapters (attached on first use, :mod:`raygym.engines.raygym_server.adapter_layers`) and
``/unload_lora_adapter`` {``lora_name``} zeroes them (the model computes its base again). The server holds one
adapter at a time; a ``/generate`` request may name it in ``lora_path`` (another name is refused with a 400).

A LoRA run does not need these routes on raygym's server: its weight sync writes the adapter tensors like any
weights. They serve adapters trained elsewhere, and clients written for SGLang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from raygym.engine_api import protocol
from raygym.engine_api.protocol import Endpoint
from raygym.engines.raygym_server.adapter_layers import adapter_names, load_adapter
from raygym.engines.serving.http import BadRequest, handles_errors, parse, register_routes
from raygym.errors import ConfigError


class LoraRoutes:
    """The adapter routes of one model; ``exclusive()`` holds the model while its adapters change."""

    def __init__(self, model: torch.nn.Module, exclusive: Callable[[], contextlib.AbstractContextManager[Any]],
                 loaded: str | None = None) -> None:
        self.model = model
        self.exclusive = exclusive
        self.loaded = loaded  # the name of the adapter served (None: none loaded by name)

    def register(self, router: web.UrlDispatcher) -> None:
        register_routes(router, {Endpoint.LOAD_LORA_ADAPTER: self.load, Endpoint.UNLOAD_LORA_ADAPTER: self.unload})

    def check_request(self, lora_path: Any) -> None:
        """A ``/generate`` request's ``lora_path`` (one name, or one per prompt): each None or the loaded name."""
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        for name in names:
            if name is not None and name != self.loaded:
                raise BadRequest(f"lora_path={name!r}: no such adapter is loaded (loaded: {self.loaded!r}); load it "
                                 "with /load_lora_adapter")

    @handles_errors
    async def load(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.LoadLoRAAdapter)
        if self.loaded is not None and self.loaded != req.lora_name:
            raise BadRequest(f"lora_name={req.lora_name!r}: raygym's server holds one adapter and serves "
                             f"{self.loaded!r}; unload it first")
        try:
            await asyncio.to_thread(self._load, req.lora_path)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        self.loaded = req.lora_name
        return web.json_response({"success": True, "loaded_adapters": {req.lora_name: req.lora_path}})

    def _load(self, directory: str) -> None:
        with self.exclusive():
            if not adapter_names(self.model):
                load_adapter(self.model, directory)
                return
            from raygym.lora import read_adapter

            _, tensors = read_adapter(directory)
            params = dict(self.model.named_parameters())
            have = set(adapter_names(self.model))
            if set(tensors) != have or any(tuple(params[n].shape) != tuple(t.shape) for n, t in tensors.items()):
                raise ConfigError(f"adapter {directory!r}: its tensors do not fit the adapters this server holds "
                                  "(another rank or other target modules); restart the server with it")
            with torch.no_grad():
                for name, tensor in tensors.items():
                    params[name].copy_(tensor)

    @handles_errors
    async def unload(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UnloadLoRAAdapter)
        if req.lora_name != self.loaded:
            raise BadRequest(f"lora_name={req.lora_name!r}: not loaded (loaded: {self.loaded!r})")
        await asyncio.to_thread(self._zero)
        self.loaded = None
        return web.json_response({"success": True, "loaded_adapters": {}})

    def _zero(self) -> None:
        params = dict(self.model.named_parameters())
        with self.exclusive(), torch.no_grad():
            for name in adapter_names(self.model):
                if ".lora_B." in name:
                    params[name].zero_()
