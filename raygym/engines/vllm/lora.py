"""LoRA adapters in raygym's vLLM adapter: SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` (and a
request's ``lora_path``) on vLLM's ``LoRARequest``\\s. Runs in vLLM's interpreter; vLLM is imported lazily.

Loading a name that is loaded already replaces it in one step: the new ``LoRARequest`` (a fresh integer id) is
added, requests from then on use it, and the old one is removed; no request finds the name missing in between
(``lora_replace`` in :mod:`raygym.engine_api.kinds`).

>>> vllm_lora_rank(8), vllm_lora_rank(4), vllm_lora_rank(20)
(8, 8, 32)
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from raygym.engine_api import protocol
from raygym.engines.serving.http import BadRequest, handles_errors, parse, result_response
from raygym.errors import ConfigError

# The ranks vLLM's LoRA kernels are built for (vllm/config/lora.py MaxLoRARanks, 0.32): max_lora_rank is one of them.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The ``max_lora_rank`` vLLM needs to serve adapters of rank ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def lora_engine_args(rank: int) -> dict[str, Any]:
    """vLLM engine arguments for serving one adapter of rank ``rank`` at a time (two held while one replaces
    the other)."""
    return {"enable_lora": True, "max_lora_rank": vllm_lora_rank(rank), "max_loras": 1, "max_cpu_loras": 2}


class VllmLora:
    """The adapters one ``AsyncLLM`` serves, by name."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.requests: dict[str, Any] = {}  # name -> vllm.lora.request.LoRARequest
        self._next_id = 1

    async def load(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory ``path`` as ``name`` (replacing what ``name`` served)."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path)
        self._next_id += 1
        if not await self.llm.add_lora(request):
            raise ConfigError(f"vLLM did not load the adapter {path!r}")
        old = self.requests.get(name)
        self.requests[name] = request
        if old is not None:
            await self.llm.remove_lora(old.lora_int_id)

    async def unload(self, name: str) -> None:
        request = self.requests.pop(name, None)
        if request is None:
            raise KeyError(name)
        await self.llm.remove_lora(request.lora_int_id)

    def loaded(self) -> dict[str, str]:
        """Name -> adapter directory of what is served."""
        return {n: r.lora_path for n, r in self.requests.items()}

    @handles_errors
    async def load_route(self, request: web.Request) -> web.Response:
        """``POST /load_lora_adapter``: SGLang's answer, ``success`` false with the reason when vLLM refuses."""
        req = await parse(request, protocol.LoadLoRAAdapter)
        try:
            await self.load(req.lora_name, req.lora_path)
        except Exception as exc:
            why = f"{type(exc).__name__}: {str(exc)[:1000]}"
            return result_response({"success": False, "error_message": why, "message": why})
        return result_response({"success": True, "loaded_adapters": self.loaded()})

    @handles_errors
    async def unload_route(self, request: web.Request) -> web.Response:
        """``POST /unload_lora_adapter``: a name not loaded is a 400 naming what is."""
        req = await parse(request, protocol.UnloadLoRAAdapter)
        try:
            await self.unload(req.lora_name)
        except KeyError:
            raise BadRequest(f"lora_name={req.lora_name!r}: not loaded (loaded: {sorted(self.requests)})") from None
        return result_response({"success": True, "loaded_adapters": self.loaded()})

    def request_for(self, name: str | None) -> Any:
        """The ``LoRARequest`` a generation names (None: the base model); KeyError for a name not loaded."""
        if name is None:
            return None
        return self.requests[name]
