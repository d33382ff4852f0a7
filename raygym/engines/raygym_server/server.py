"""raygym's built-in inference server: SGLang's native HTTP API on a Hugging Face model.

Run it as::

    RAYGYM_ENGINE_API_KEY=... python -m raygym.engines.raygym_server.server --model-path P --host 127.0.0.1 --port 30000 \\
        [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16] \\
        [--max-running-requests 64] [--custom-weight-loader pkg.mod:fn ...] [--weight-source PREFIX ...] \\
        [--weight-version 0] [--seed 0] [--num-threads N] [--lora-config JSON | --lora-adapter DIR]

Routes and bodies are SGLang's (:mod:`raygym.engine_api.protocol`): ``/generate``, ``/health``,
``/health_generate``, ``/model_info`` (and the deprecated ``/get_model_info``), ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/abort_request``, ``/release_memory_occupation``,
``/resume_memory_occupation``, the weight routes of :mod:`raygym.engines.raygym_server.weights`, plus
``GET /raygym/stats`` (batching counters). With an API key in ``RAYGYM_ENGINE_API_KEY`` every route but
``/health*`` requires ``Authorization: Bearer <key>`` (SGLang's ``--api-key`` rule); the key never goes
on the command line. Routes that change state take POST with a JSON body only.

Generation runs on :class:`raygym.engines.raygym_server.generation.GenerationEngine`'s own thread; weight loading and
process-group work run in executor threads, so the HTTP loop never blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from aiohttp import web

from raygym.cluster.cpu_threads import make_serial_default, pin_process
from raygym.engine_api import protocol
from raygym.engine_api.auth import engine_api_key
from raygym.engine_api.protocol import STATE_CHANGING, Endpoint
from raygym.engines.raygym_server.generate import GenerateRoute, Limits
from raygym.engines.raygym_server.generation import (
    EngineUnavailable,
    GenerationEngine,
    GenerationRequest,
    SamplingParams,
)
from raygym.engines.raygym_server.lora import LoraRoutes
from raygym.engines.raygym_server.routing_capture import RoutingCapture
from raygym.engines.raygym_server.weights import ServerWeightReceiver, WeightRoutes
from raygym.engines.serving.http import (
    guard_middleware,
    handles_errors,
    parse,
    ping,
    register_routes,
    server_info_body,
)
from raygym.lora import ADAPTER_NAME
from raygym.routed_experts import SERVER_FLAG
from raygym.weightsync.codec import checksum as tensor_checksum
from raygym.weightsync.codec import dtype_from_name
from raygym.weightsync.sources import WeightSources

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("raygym.engines.raygym_server.server")

HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
__all__ = ["InferenceServer", "main", "parse_args", "serve", "tensor_checksum"]


# --------------------------------------------------------------------------- model


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return torch.device(device)


def checkpoint_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype a HF config (``config.json`` as a dict) declares: ``dtype`` (transformers 5) or
    ``torch_dtype`` (earlier); None when it names none or one raygym does not know.

    >>> checkpoint_dtype({"torch_dtype": "bfloat16"}), checkpoint_dtype({"dtype": "float32"}), checkpoint_dtype({})
    (torch.bfloat16, torch.float32, None)
    """
    name = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(name, str):
        return None
    try:
        return dtype_from_name(name)
    except ValueError:
        return None


def resolve_dtype(dtype: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on GPU; float32 on CPU (half precision is slow there)."""
    if dtype != "auto":
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise SystemExit(f"--dtype {dtype}: not a torch dtype (auto, float32, bfloat16, float16)")
        return value
    if device.type == "cpu":
        return torch.float32
    return config_dtype or torch.bfloat16


def load_model(model_path: str, device: torch.device, dtype: str) -> tuple[PreTrainedModel, Any, str]:
    """Load a HF causal LM, or a vision-language model (a config with ``vision_config``: transformers'
    ``AutoModelForImageTextToText``, e.g. ``Qwen2_5_VLForConditionalGeneration``), and its tokenizer (None when
    the checkpoint has none), in the same dtype policy.

    ``builtin:`` URIs (``raygym.builtin``) are materialised into a temp dir first.
    Returns (model, tokenizer, local path).
    """
    from transformers import AutoConfig, AutoTokenizer

    from raygym.builtin import is_builtin, materialize_model
    from raygym.vision.qwen_vl import auto_model_class

    if is_builtin(model_path):
        model_path = materialize_model(model_path, tempfile.mkdtemp(prefix="raygym-model-"))
    config = AutoConfig.from_pretrained(model_path)
    config_dtype = checkpoint_dtype(config.to_dict())
    auto = auto_model_class(config)
    model = auto.from_pretrained(model_path, dtype=resolve_dtype(dtype, config_dtype, device))
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorator types `to` as unbound
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, model_path


def load_image_processor(model: torch.nn.Module, model_path: str) -> Any:
    """A vision-language model's image processor (``AutoImageProcessor`` of its checkpoint); None for a text-only
    model, or, with a warning, for a checkpoint without one (its requests with images are then refused)."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        log.warning("%s: no image processor (%s); requests with images will be refused", model_path, exc)
        return None


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# --------------------------------------------------------------------------- HTTP


class InferenceServer:
    """The HTTP front of one :class:`GenerationEngine` plus weight management."""

    def __init__(
        self,
        engine: GenerationEngine,
        *,
        model_path: str,
        tokenizer: Any = None,
        weight_version: str = "default",
        custom_loaders: tuple[str, ...] = (),
        weight_sources: tuple[str, ...] = (),
        weight_update_timeout_s: float = 600.0,
        api_key: str | None = None,
        limits: Limits | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.limits = limits or Limits(context_length=engine.max_positions)
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.released: set[str] = set()
        self._device = engine.device
        local_model_dir = model_path if "://" not in model_path and not model_path.startswith("builtin:") else ""
        receiver = ServerWeightReceiver(
            engine.model, device=engine.device, weight_version=str(weight_version), custom_loaders=custom_loaders,
            timeout_s=weight_update_timeout_s, exclusive=lambda: engine.exclusive(wait_idle=not engine.paused),
            reading=lambda: engine.model_lock, sources=WeightSources([*weight_sources, local_model_dir]),
        )
        self.weights = WeightRoutes(engine, receiver, lambda: self.released)
        self.lora = LoraRoutes(engine.model, lambda: engine.exclusive(wait_idle=not engine.paused), loaded=lora_name)
        self.generation = GenerateRoute(engine, tokenizer, self.limits, self.lora.check_request,
                                        lambda: self.weight_version)
        engine.weight_label = lambda: receiver.weight_version  # stamps every generated token with its version

    @property
    def weight_version(self) -> str:
        return self.weights.weight_version

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              middlewares=[guard_middleware(self.api_key, frozenset(e.value for e in STATE_CHANGING))])
        register_routes(app.router, {
            Endpoint.GENERATE: self.generation.generate, Endpoint.HEALTH: self.health,
            Endpoint.HEALTH_GENERATE: self.health_generate, Endpoint.MODEL_INFO: self.model_info,
            Endpoint.GET_MODEL_INFO: self.model_info, Endpoint.GET_WEIGHT_VERSION: self.get_weight_version,
            Endpoint.SERVER_INFO: self.server_info, Endpoint.GET_SERVER_INFO: self.server_info, Endpoint.PING: ping,
            Endpoint.WEIGHT_VERSION: self.get_weight_version, Endpoint.RAYGYM_STATS: self.stats,
            Endpoint.FLUSH_CACHE: self.flush_cache, Endpoint.PAUSE_GENERATION: self.pause_generation,
            Endpoint.CONTINUE_GENERATION: self.continue_generation, Endpoint.ABORT_REQUEST: self.abort_request,
            Endpoint.RELEASE_MEMORY: self.release_memory, Endpoint.RESUME_MEMORY: self.resume_memory,
        })
        self.weights.register(app.router)
        self.lora.register(app.router)
        return app

    # ----- health and info -----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Runs one greedy token through the model; 503 when memory is released or no token came in
        ``HEALTH_GENERATE_TIMEOUT_S``. While generation is paused (a weight update) the probe waits in line like any
        request, as on SGLang: a pause is the trainer's doing, not a sign that the server is broken."""
        if self.engine.released:
            return web.Response(status=503, text="memory is released\n")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = GenerationRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True),
            on_done=_resolver(loop, fut),
        )
        try:
            self.engine.submit(req)
            await asyncio.wait_for(fut, HEALTH_GENERATE_TIMEOUT_S)
        except (EngineUnavailable, asyncio.TimeoutError):
            self.engine.abort(req.rid)
            return web.Response(status=503)
        # A probe a pause aborted was still answered by the scheduler: healthy, as SGLang counts any answer.
        healthy = (req.finish_reason or {}).get("type") != "abort" or not self.engine.released
        return web.Response(status=200 if healthy else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.model.config
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": self.engine.vision is not None and self.engine.vision.unsupported is None,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": config.architectures,
            "device": str(self._device),
            "max_running_requests": self.engine.max_running_requests,
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/server_info``: the launch settings under ``ServerArgs``' names, and live state per data-
        parallel rank (``internal_states``)."""
        return web.json_response(server_info_body(
            model_path=self.model_path, context_length=self.limits.context_length,
            max_running_requests=self.engine.max_running_requests, device=str(self._device),
            weight_version=self.weight_version, running=self.engine.pending()))

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({
            **self.engine.stats.as_dict(),
            "pending": self.engine.pending(),
            "paused": self.engine.paused,
            "released": sorted(self.released),
            "weight_version": self.weight_version,
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache to drop; like SGLang, refuse while requests are running or waiting.
        ok = self.engine.pending() == 0
        return web.Response(text=FLUSH_CACHE_TEXT if ok else "Flush cache failed: requests are pending.\n",
                            status=200 if ok else 400)

    # ----- pause / abort -----
    @handles_errors
    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.PauseGeneration, required=False)
        await asyncio.to_thread(self.engine.pause, req.mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @handles_errors
    async def continue_generation(self, request: web.Request) -> web.Response:
        await parse(request, protocol.ContinueGeneration, required=False)
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @handles_errors
    async def abort_request(self, request: web.Request) -> web.Response:
        """Abort one request by ``rid`` or every one; an empty ``rid`` without ``abort_all`` does nothing (SGLang)."""
        req = await parse(request, protocol.AbortRequest, required=False)
        if req.rid or req.abort_all:
            self.engine.abort(req.rid or None, abort_all=req.abort_all, message="aborted by /abort_request")
        return web.Response(status=200)

    # ----- memory -----
    @handles_errors
    async def release_memory(self, request: web.Request) -> web.Response:
        """Weights move to CPU on GPU (and stay put on CPU); generation is refused until resumed."""
        req = await parse(request, protocol.MemoryTags, required=False)
        await asyncio.to_thread(self._move_memory, set(req.tags or ("weights", "kv_cache")), True)
        return web.json_response(None)

    @handles_errors
    async def resume_memory(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.MemoryTags, required=False)
        await asyncio.to_thread(self._move_memory, set(req.tags or ("weights", "kv_cache")), False)
        return web.json_response(None)

    def _move_memory(self, tags: set[str], release: bool) -> None:
        with self.engine.exclusive(wait_idle=not self.engine.paused):
            if release:
                if "weights" in tags and "weights" not in self.released and self._device.type == "cuda":
                    self.engine.model.to("cpu")
                    torch.cuda.empty_cache()
                self.released |= tags
            else:
                if "weights" in tags and "weights" in self.released and self._device.type == "cuda":
                    self.engine.model.to(self._device)
                self.released -= tags
            self.engine.set_released(bool(self.released))

    async def close(self) -> None:
        self.weights.receiver.close()
        await asyncio.to_thread(self.engine.stop)


def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[GenerationRequest], None]:
    """A callback for the generation thread that completes ``fut`` on the HTTP loop."""

    def done(req: GenerationRequest) -> None:
        def settle() -> None:
            if not fut.done():
                fut.set_result(req)

        loop.call_soon_threadsafe(settle)

    return done


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="python -m raygym.engines.raygym_server.server", description=doc.splitlines()[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint directory or builtin:tiny-qwen3")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (never 0.0.0.0 unless you mean it)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-running-requests", type=int, default=64, help="sequences decoded together (batch size)")
    p.add_argument("--max-queued-requests", type=int, default=4096,
                   help="sequences waiting to run; a request that does not fit gets HTTP 503")
    p.add_argument("--max-n", type=int, default=128, help="samples per prompt (sampling_params.n)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt + max_new_tokens per sequence (default: the model's max_position_embeddings)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="largest request body; more gets HTTP 413")
    p.add_argument(
        "--custom-weight-loader", nargs="*", default=[], help="pkg.mod:fn loaders a load_format may name"
    )
    p.add_argument(
        "--weight-source", action="append", default=[],
        help="path or fsspec URL prefix /update_weights_from_disk may read (repeatable; the model's own "
             "directory is always allowed; without any, local paths only)",
    )
    p.add_argument("--weight-version", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-wait-ms", type=float, default=3.0, help="linger for more requests before a batch")
    p.add_argument(
        "--weight-update-timeout", type=float, default=600.0, help="seconds for group joins and broadcasts"
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch intra-op threads; default on CPU: --max-threads for a model of at least 1M parameters, else 1",
    )
    p.add_argument("--max-threads", type=int, default=1,
                   help="CPU cores this server may decode on (the launcher grants them when rollout and training "
                        "take turns); used by models large enough to gain from them")
    p.add_argument("--cpu-cores", default=None, type=_core_list,
                   help="comma-separated CPU cores this server runs on (pinned; the launcher's split when engines "
                        "decode while the trainer trains)")
    p.add_argument("--lora-config", default=None,
                   help="LoRA: attach adapters of this spec (raygym.lora.LoraSpec.to_json), B = 0, synced later")
    p.add_argument("--lora-adapter", default=None, help="LoRA: attach and load this PEFT adapter directory")
    p.add_argument(SERVER_FLAG, action="store_true",
                   help="MoE: return the experts each token was routed to when a request asks (return_routed_experts)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    for flag in ("max_running_requests", "max_queued_requests", "max_n", "context_length", "max_body_bytes",
                 "max_threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    return args


def cpu_decode_threads(granted: int, params: int) -> int:
    """Torch threads of a CPU decode: the ``granted`` cores for a model of at least 1M parameters, else one.
    A tiny model's decode step is too short for a second thread to pay for waking it (measured,
    ``raygym train`` defaults, 80K parameters on 2 cores: rollout 0.055 s a step on one thread, 0.066 s on
    two), where a 10.6M model's rollout went from 3.46 s to 2.54 s (``raygym/bench/e2e.py``).

    >>> cpu_decode_threads(2, 80_000), cpu_decode_threads(2, 10_600_000), cpu_decode_threads(1, 10**9)
    (1, 2, 1)
    """
    return max(1, granted) if params >= 1_000_000 else 1


def _core_list(text: str) -> list[int]:
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cores = []
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of core numbers, e.g. 2,3")
    return cores


async def serve(args: argparse.Namespace) -> None:
    if args.cpu_cores:  # before any thread starts: torch's and the server's inherit it
        pin_process(args.cpu_cores)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    model, tokenizer, local_path = load_model(args.model_path, device, args.dtype)
    threads = None
    if device.type == "cpu":  # the generation thread claims them; every other thread runs torch serially
        threads = args.num_threads or cpu_decode_threads(args.max_threads, sum(t.numel() for t in model.parameters()))
        make_serial_default()
    elif args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.lora_adapter or args.lora_config:  # adapters beside the base weights (raygym.engines.raygym_server.adapter_layers)
        from raygym.engines.raygym_server.adapter_layers import attach_adapters, load_adapter
        from raygym.lora import LoraSpec

        if args.lora_adapter:
            load_adapter(model, args.lora_adapter)
        else:
            attach_adapters(model, LoraSpec.from_config(json.loads(args.lora_config)))
    engine = GenerationEngine(
        model,
        eos_token_ids=sorted(eos_ids(model, tokenizer)),
        tokenizer=tokenizer,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        batch_wait_s=args.batch_wait_ms / 1000.0,
        pad_token_id=int(getattr(model.config, "pad_token_id", None) or 0),
        max_queued_requests=args.max_queued_requests,
        compute_threads=threads,
        image_processor=load_image_processor(model, local_path),
    )
    if args.enable_return_routed_experts:
        engine.routing = RoutingCapture(model)
    limits = Limits(context_length=args.context_length or engine.max_positions, max_n=args.max_n,
                    max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes)
    server = InferenceServer(
        engine,
        model_path=args.model_path,
        tokenizer=tokenizer,
        weight_version=args.weight_version,
        custom_loaders=tuple(args.custom_weight_loader),
        weight_sources=tuple(args.weight_source),
        weight_update_timeout_s=args.weight_update_timeout,
        api_key=engine_api_key(),
        limits=limits,
        lora_name=ADAPTER_NAME if args.lora_adapter or args.lora_config else None,
    )
    engine.start()
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its requests
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    shown = f", {threads} thread(s)" if threads is not None else ""
    shown += f", pinned to cores {','.join(map(str, args.cpu_cores))}" if args.cpu_cores else ""
    print(f"raygym server ready on http://{args.host}:{args.port} (model {local_path}, {device}{shown})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await server.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
