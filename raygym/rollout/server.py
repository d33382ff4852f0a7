"""raygym's built-in inference server: SGLang's native HTTP API subset on a Hugging Face model.

Run it as::

    python -m raygym.rollout.server --model-path P --host 127.0.0.1 --port 30000 \\
        [--device auto|cpu|cuda] [--dtype auto|float32|bfloat16|float16] \\
        [--max-running-requests 64] [--custom-weight-loader pkg.mod:fn ...] \\
        [--weight-version 0] [--seed 0] [--num-threads N]

Endpoints mirror SGLang's request and response shapes (``/generate``, ``/health``,
``/health_generate``, ``/get_model_info``, ``/get_weight_version``, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/abort_request``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/update_weights_from_disk``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``) plus two raygym extensions: ``POST /raygym/weights_checksum``
and ``GET /raygym/stats`` (batching counters). Errors are SGLang's
``{"error": {"message": ...}}`` with status 400; weight endpoints answer
``{"success": bool, "message": str}`` with 200 or 400.

Generation runs on :class:`raygym.rollout.generation.GenerationEngine`'s own thread; weight
loading and process-group work run in executor threads, so the HTTP loop never blocks.

Weight updates: groups are joined the SGLang way (:func:`new_process_group`); every receive-side
broadcast is bounded by ``--weight-update-timeout``; requests of one group are received in arrival
order (a sender may post bucket k+1 while bucket k still loads); ``/update_weights_from_disk``
refuses a raygym version directory that has a manifest but no ``DONE`` marker.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import importlib
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from raygym.rollout.generation import (
    PAUSE_MODES,
    EngineUnavailable,
    GenerationEngine,
    GenerationRequest,
    SamplingParams,
)
from raygym.weightsync.transport_dist import ScratchBuffers

log = logging.getLogger("raygym.rollout.server")

WeightLoader = Callable[[torch.nn.Module, Iterable[tuple[str, torch.Tensor]]], Any]
HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class BadRequest(ValueError):
    """A client mistake; answered with HTTP 400 and this message."""


# --------------------------------------------------------------------------- weights


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3_64 hexdigest of a tensor's raw bytes (contiguous, native byte order).

    Uses ``raygym.weightsync.codec.checksum`` when that module exists so both sides agree.
    """
    try:
        from raygym.weightsync.codec import checksum
    except ImportError:
        import xxhash

        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        return xxhash.xxh3_64_hexdigest(data)
    return checksum(t)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer by its HF state-dict name (tied names included)."""
    return dict(model.state_dict(keep_vars=True))


def default_weight_loader(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into the model's parameters by HF name (dtype cast to the parameter's).

    Raises ``BadRequest`` naming unknown names and shape mismatches; nothing is copied for a
    tensor that does not fit.
    """
    params = model_tensors(model)
    unknown, mismatched = [], []
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                unknown.append(name)
            elif tuple(target.shape) != tuple(tensor.shape):
                mismatched.append(f"{name}: got {tuple(tensor.shape)}, model has {tuple(target.shape)}")
            else:
                target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
    problems = []
    if unknown:
        problems.append(f"unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if mismatched:
        problems.append(f"shape mismatch {mismatched[:5]}")
    if problems:
        raise BadRequest("; ".join(problems) + " (names must be the HF checkpoint's state-dict names)")


def check_metadata(model: torch.nn.Module, names: list[str], shapes: list[list[int]]) -> None:
    """Check names and shapes against the model before any tensor is loaded."""
    params = model_tensors(model)
    problems = [n for n in names if n not in params]
    bad_shapes = [
        f"{n}: got {tuple(s)}, model has {tuple(params[n].shape)}"
        for n, s in zip(names, shapes, strict=True)
        if n in params and tuple(params[n].shape) != tuple(s)
    ]
    if problems or bad_shapes:
        raise BadRequest(
            f"unknown parameter names {problems[:5]}; shape mismatch {bad_shapes[:5]} "
            "(names must be the HF checkpoint's state-dict names)"
        )


def _canonical_import_path(path: str) -> str:
    return path.replace(":", ".")


def import_callable(path: str) -> Callable[..., Any]:
    """Import ``pkg.mod:fn`` or ``pkg.mod.fn``."""
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise ValueError(
            f"custom weight loader {path!r}: expected 'pkg.module:function' or 'pkg.module.function'"
        )
    return getattr(importlib.import_module(module), attr)


class WeightLoaders:
    """Loaders a ``load_format`` may name: the default copy, or ones registered at start-up."""

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self._custom: dict[str, WeightLoader] = {}
        for path in paths:
            self._custom[_canonical_import_path(path)] = import_callable(path)

    def resolve(self, load_format: str | None) -> WeightLoader | None:
        """The custom loader named by ``load_format``, or None for the default loader."""
        if load_format in (None, "", "auto", "safetensors", "default"):
            return None
        loader = self._custom.get(_canonical_import_path(load_format))
        if loader is None:
            raise BadRequest(
                f"load_format={load_format!r}: not a registered custom weight loader; registered: "
                f"{sorted(self._custom) or 'none'} (start the server with --custom-weight-loader {load_format})"
            )
        return loader


def read_safetensors(url: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from one ``.safetensors`` file or every one in a directory, any fsspec URL."""
    import fsspec
    from safetensors.torch import load as load_bytes

    fs, root = fsspec.core.url_to_fs(url)
    if root.endswith(".safetensors"):
        files = [root]
    else:
        files = sorted(fs.glob(root.rstrip("/") + "/*.safetensors"))
    if not files:
        raise BadRequest(f"model_path={url!r}: no .safetensors files found")
    for path in files:
        yield from load_bytes(fs.cat_file(path)).items()


def weights_source(url: str) -> Callable[[], Iterable[tuple[str, torch.Tensor]]]:
    """What ``/update_weights_from_disk`` reads from ``url``, checked before anything is loaded.

    A raygym version directory (one with ``manifest.json``) must carry its ``DONE`` marker: a
    manifest without it is a sync still being written (or one that died), and is refused. Such a
    directory is read shard by shard as listed in the manifest; anything else is a HF checkpoint.
    """
    import fsspec

    from raygym.weightsync.transport_disk import DONE_FILE, MANIFEST_FILE, read_version_dir

    fs, root = fsspec.core.url_to_fs(url)
    if not root.endswith(".safetensors") and fs.exists(f"{root.rstrip('/')}/{MANIFEST_FILE}"):
        if not fs.exists(f"{root.rstrip('/')}/{DONE_FILE}"):
            raise BadRequest(
                f"model_path={url!r} has {MANIFEST_FILE} but no {DONE_FILE} marker: the version is "
                "incomplete (still being written, or its writer failed); retry once DONE exists"
            )
        return lambda: read_version_dir(url)
    return lambda: read_safetensors(url)


@dataclass
class WeightUpdateGroup:
    """A torch.distributed process group of its own (not the default group), joined by name.

    Rank 0 is the sender (trainer); engines join at ``rank_offset``. Collectives are called on the
    group object directly.
    """

    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any
    store: Any
    timeout_s: float = 600.0
    # Requests of one group are received strictly in arrival order (a sender may post bucket k+1
    # while this server still loads bucket k); receive buffers are reused between requests.
    order: asyncio.Lock = field(default_factory=asyncio.Lock)
    scratch: Any = field(default_factory=lambda: ScratchBuffers())

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from group rank ``src``; raises when it does not finish in ``timeout_s``."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        work = self.pg.broadcast([tensor], opts)
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"group {self.name!r}: broadcast did not finish in {self.timeout_s} s")

    def destroy(self) -> None:
        """Leave the group and free its name so a group of the same name can be created again."""
        import torch.distributed as dist

        try:
            dist.destroy_process_group(self.pg)
        except Exception:  # a peer already gone; nothing left to release
            log.debug("destroying process group %s failed", self.name, exc_info=True)
        # destroy_process_group leaves the name in torch's C++ registry for groups created outside
        # the default world; drop it so the name can be reused (e.g. after a failed sync).
        unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
        if unregister is not None:
            try:
                unregister(self.name)
            except Exception:
                log.debug("unregistering process group %s failed", self.name, exc_info=True)


def new_process_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> WeightUpdateGroup:
    """Create (rank 0) or join a standalone gloo / nccl group, exactly as SGLang's engines do.

    Same rendezvous as SGLang's ``init_custom_process_group``: a TCP store at
    ``tcp://master_address:master_port`` hosted by rank 0, then a new process group named
    ``group_name`` on it. So one sender joins stock SGLang and raygym's server the same way, and
    a process that already has a default group can join too (the default group is not touched).
    Blocks until all ``world_size`` members joined or ``timeout_s`` passed.

    >>> # sender: g = new_process_group(master_address="127.0.0.1", master_port=29600, rank=0,
    >>> #     world_size=2, group_name="weights", backend="gloo", timeout_s=60); g.broadcast(t)
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl"):
        raise BadRequest(f"backend={backend!r}: must be 'gloo' or 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise BadRequest("backend='nccl' needs CUDA; use backend='gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # torch has no public API for a group outside the default world; SGLang uses this helper too.
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    return WeightUpdateGroup(group_name, rank, world_size, backend, pg, store, timeout_s)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    attr = str(name).removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise BadRequest(f"dtype {name!r}: not a torch dtype (e.g. 'bfloat16', 'float32')")
    return dtype


# --------------------------------------------------------------------------- model


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on GPU; float32 on CPU (half precision is slow there)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    return config_dtype or torch.bfloat16


def load_model(model_path: str, device: torch.device, dtype: str) -> tuple[torch.nn.Module, Any, str]:
    """Load a HF causal LM and its tokenizer (None when the checkpoint has none).

    ``builtin:`` URIs (``raygym.builtin``) are materialised into a temp dir first.
    Returns (model, tokenizer, local path).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from raygym.builtin import is_builtin, materialize_model

    if is_builtin(model_path):
        model_path = materialize_model(model_path, tempfile.mkdtemp(prefix="raygym-model-"))
    config = AutoConfig.from_pretrained(model_path)
    config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype(dtype, config_dtype, device))
    model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, model_path


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


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def result_response(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


async def read_json(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        if required:
            raise BadRequest(f"{request.path}: expected a JSON object body")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"{request.path}: body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: body must be a JSON object, got {type(body).__name__}")
    return body


def get_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """Read a typed field from a request body; missing without default or wrong type -> 400."""
    if name not in body or body[name] is None:
        if default is ...:
            raise BadRequest(f"missing required field {name!r}")
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"{name}={value!r}: wrong type")
    if not isinstance(value, kind):
        raise BadRequest(f"{name}={value!r}: must be {kind}")
    return value


def handles_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ValueError (BadRequest included) / EngineUnavailable into SGLang's 400 error body; log the rest."""

    @functools.wraps(fn)
    async def wrapper(self: InferenceServer, request: web.Request) -> web.StreamResponse:
        try:
            return await fn(self, request)
        except (ValueError, EngineUnavailable) as exc:  # BadRequest and SamplingParams errors
            return error_response(str(exc))
        except Exception as exc:
            log.exception("%s failed", request.path)
            return error_response(f"{request.path} failed: {type(exc).__name__}: {exc}", status=500)

    return wrapper


class InferenceServer:
    """The HTTP front of one :class:`GenerationEngine` plus weight management."""

    def __init__(
        self,
        engine: GenerationEngine,
        *,
        model_path: str,
        tokenizer: Any = None,
        weight_version: str = "default",
        loaders: WeightLoaders | None = None,
        weight_update_timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.weight_version = str(weight_version)
        self.loaders = loaders or WeightLoaders()
        self.weight_update_timeout_s = weight_update_timeout_s
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.released: set[str] = set()
        self._device = engine.device

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
            r.add_route(method, "/release_memory_occupation", self.release_memory)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory)
            r.add_route(method, "/raygym/stats", self.stats)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/raygym/weights_checksum", self.weights_checksum)
        return app

    # ----- generation -----
    @handles_errors
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by raygym's server; send stream=false")
        prompts, single = self._prompts(body)
        params = self._per_item(body.get("sampling_params"), len(prompts), "sampling_params", dict, {})
        rids = self._per_item(body.get("rid"), len(prompts), "rid", str, None)
        want_logprob = self._per_item(body.get("return_logprob"), len(prompts), "return_logprob", bool, False)
        with_text = bool(body.get("return_text_in_logprobs", False))
        parsed = [SamplingParams.from_dict(p) for p in params]
        loop = asyncio.get_running_loop()
        jobs: list[tuple[GenerationRequest, asyncio.Future, bool]] = []
        started = time.monotonic()
        for ids, sp, rid, lp in zip(prompts, parsed, rids, want_logprob, strict=True):
            rid = rid or uuid.uuid4().hex
            for _ in range(sp.n):
                fut = loop.create_future()
                req = GenerationRequest(rid=rid, input_ids=ids, params=sp, on_done=_resolver(loop, fut))
                jobs.append((req, fut, lp))
        for req, _, _ in jobs:
            self.engine.submit(req)
        await asyncio.gather(*(fut for _, fut, _ in jobs))
        latency = time.monotonic() - started
        outputs = [self._output(req, lp, with_text, latency) for req, _, lp in jobs]
        return web.json_response(outputs[0] if single and len(outputs) == 1 else outputs)

    def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        ids, text = body.get("input_ids"), body.get("text")
        if (ids is None) == (text is None):
            raise BadRequest("send exactly one of 'input_ids' (token ids) or 'text'")
        if text is not None:
            if self.tokenizer is None:
                raise BadRequest("this model has no tokenizer; send 'input_ids' instead of 'text'")
            texts = [text] if isinstance(text, str) else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("'text' must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts], isinstance(text, str)
        single = isinstance(ids, list) and (not ids or not isinstance(ids[0], list))
        batch = [ids] if single else ids
        vocab = self.engine.model.config.vocab_size
        for row in batch:
            if not isinstance(row, list) or not row:
                raise BadRequest("'input_ids' must be a non-empty list of ints or a list of such lists")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row):
                raise BadRequest(f"'input_ids' must hold ints in [0, {vocab}) (the model's vocab_size)")
        return batch, single

    @staticmethod
    def _per_item(value: Any, count: int, name: str, kind: type, default: Any) -> list[Any]:
        if value is None:
            return [default] * count
        if isinstance(value, kind):
            return [value] * count
        if isinstance(value, list) and len(value) == count and all(isinstance(v, kind) for v in value):
            return list(value)
        raise BadRequest(f"{name}: must be one {kind.__name__} or a list of {count} of them (one per prompt)")

    def _output(
        self, req: GenerationRequest, logprob: bool, with_text: bool, latency: float
    ) -> dict[str, Any]:
        reason = req.finish_reason or {"type": "abort", "message": "unfinished"}
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": latency,
        }
        if logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, self._decode([tok], False) if with_text else None]
                for lp, tok in zip(req.output_logprobs, req.output_ids, strict=True)
            ]
        return {"text": self._text(req), "output_ids": list(req.output_ids), "meta_info": meta}

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _text(self, req: GenerationRequest) -> str:
        p, reason = req.params, req.finish_reason or {}
        ids = req.output_ids
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim:
            ids = ids[:-1]
        text = self._decode(ids, p.skip_special_tokens)
        matched = reason.get("matched")
        if isinstance(matched, str) and not p.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text

    # ----- health and info -----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Runs one greedy token through the model; 503 when paused, released or stuck."""
        if self.engine.paused or self.engine.released:
            return web.Response(status=503, text="generation is paused or memory is released\n")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = GenerationRequest(
            rid=f"HEALTH_CHECK_{time.time()}",
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
        ok = (req.finish_reason or {}).get("type") != "abort"
        return web.Response(status=200 if ok else 503)

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "device": str(self._device),
                "max_running_requests": self.engine.max_running_requests,
                "raygym_stats": self.engine.stats.as_dict(),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.engine.stats.as_dict(),
                "pending": self.engine.pending(),
                "paused": self.engine.paused,
                "released": sorted(self.released),
                "weight_version": self.weight_version,
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        # No prefix cache to drop; like SGLang, refuse while requests are running or waiting.
        ok = self.engine.pending() == 0
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if ok else 400)

    # ----- pause / abort -----
    @handles_errors
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        mode = get_field(body, "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: must be one of {list(PAUSE_MODES)}")
        await asyncio.to_thread(self.engine.pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @handles_errors
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        rid = get_field(body, "rid", str, "")
        abort_all = get_field(body, "abort_all", bool, False)
        if not rid and not abort_all:
            raise BadRequest("send 'rid' (a request id) or 'abort_all': true")
        self.engine.abort(rid or None, abort_all=abort_all, message="aborted by /abort_request")
        return web.Response(status=200)

    # ----- memory -----
    @handles_errors
    async def release_memory(self, request: web.Request) -> web.Response:
        """Weights move to CPU on GPU (and stay put on CPU); generation is refused until resumed."""
        tags = self._tags(await read_json(request, required=False))
        await asyncio.to_thread(self._move_memory, tags, release=True)
        return web.json_response(None)

    @handles_errors
    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = self._tags(await read_json(request, required=False))
        await asyncio.to_thread(self._move_memory, tags, release=False)
        return web.json_response(None)

    @staticmethod
    def _tags(body: dict[str, Any]) -> set[str]:
        tags = get_field(body, "tags", list, ["weights", "kv_cache"])
        unknown = set(tags) - {"weights", "kv_cache", "cuda_graph"}
        if unknown:
            raise BadRequest(f"tags={tags!r}: unknown tags {sorted(unknown)}; use 'weights', 'kv_cache'")
        return set(tags)

    def _move_memory(self, tags: set[str], *, release: bool) -> None:
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

    def _require_weights_resident(self) -> None:
        if "weights" in self.released:
            raise BadRequest(
                "weights are released; call /resume_memory_occupation with tags ['weights'] first"
            )

    # ----- weight updates -----
    @handles_errors
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        model_path = get_field(body, "model_path", str)
        loader = self.loaders.resolve(get_field(body, "load_format", str, None))
        version = body.get("weight_version")
        self._require_weights_resident()
        if get_field(body, "abort_all_requests", bool, False):
            self.engine.abort(abort_all=True, message="aborted for a weight update")
        try:
            source = await asyncio.to_thread(weights_source, model_path)
            await asyncio.to_thread(self._load, source, loader)
        except BadRequest as exc:
            return result_response(
                False, f"Failed to update weights from {model_path}: {exc}", num_paused_requests=0
            )
        except Exception as exc:  # a corrupt or unreadable shard: the sender names this engine
            log.exception("update_weights_from_disk failed")
            return result_response(
                False, f"Failed to update weights from {model_path}: {type(exc).__name__}: {exc}",
                num_paused_requests=0,
            )
        self.model_path = model_path
        message = f"Succeeded to update model weights from {model_path}."
        if version is not None:
            self.weight_version = str(version)
            message += f" Weight version updated to {self.weight_version}."
        return result_response(True, message, num_paused_requests=0)

    def _load(
        self, tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], loader: WeightLoader | None
    ) -> None:
        with self.engine.exclusive(wait_idle=not self.engine.paused):
            (loader or default_weight_loader)(self.engine.model, tensors())

    @handles_errors
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        name = get_field(body, "group_name", str, "weight_update_group")
        if name in self.groups:
            return result_response(False, f"group {name!r} already exists; destroy it first")
        kwargs = dict(
            master_address=get_field(body, "master_address", str),
            master_port=get_field(body, "master_port", int),
            rank=get_field(body, "rank_offset", int),
            world_size=get_field(body, "world_size", int),
            group_name=name,
            backend=get_field(body, "backend", str, "nccl"),
            timeout_s=self.weight_update_timeout_s,
        )
        try:
            self.groups[name] = await asyncio.to_thread(lambda: new_process_group(**kwargs))
        except BadRequest:
            raise
        except Exception as exc:
            return result_response(False, f"Failed to init group {name!r}: {type(exc).__name__}: {exc}")
        return result_response(True, f"Succeeded to initialize custom process group {name!r}.")

    @handles_errors
    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        names = get_field(body, "names", list)
        dtypes = [parse_dtype(d) for d in get_field(body, "dtypes", list)]
        shapes = get_field(body, "shapes", list)
        name = get_field(body, "group_name", str, "weight_update_group")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(
                f"names, dtypes and shapes must have the same length ({len(names)}, {len(dtypes)}, {len(shapes)})"
            )
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"group_name={name!r}: no such group; call /init_weights_update_group first")
        loader = self.loaders.resolve(get_field(body, "load_format", str, None))
        self._require_weights_resident()
        if get_field(body, "abort_all_requests", bool, False):
            self.engine.abort(abort_all=True, message="aborted for a weight update")
        try:
            async with group.order:  # FIFO: requests are received in the order they arrived
                received = await asyncio.to_thread(self._receive, group, names, dtypes, shapes)
                await asyncio.to_thread(self._load_received, names, shapes, received, loader)
        except BadRequest as exc:
            return result_response(False, f"Failed to update weights: {exc}")
        except Exception as exc:
            log.exception("update_weights_from_distributed failed")
            return result_response(False, f"Failed to update weights: {type(exc).__name__}: {exc}")
        message = "Succeeded to update parameter online."
        version = body.get("weight_version")
        if version is not None:
            self.weight_version = str(version)
            message += f" Weight version updated to {self.weight_version}."
        return result_response(True, message)

    def _receive(
        self, group: WeightUpdateGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive every tensor of the request by broadcast from rank 0, in order, each within the
        group's timeout. Done before the model is taken, so a busy engine never stalls the sender."""
        from raygym.weightsync.transport_dist import receive_tensors

        device = self._device if group.backend == "nccl" else torch.device("cpu")
        specs = list(zip(names, dtypes, shapes, strict=True))
        return list(receive_tensors(group.pg, specs, device, group.timeout_s, group.scratch))

    def _load_received(
        self,
        names: list[str],
        shapes: list[list[int]],
        received: list[tuple[str, torch.Tensor]],
        loader: WeightLoader | None,
    ) -> None:
        with self.engine.exclusive(wait_idle=not self.engine.paused):
            if loader is None:
                check_metadata(self.engine.model, names, shapes)
            (loader or default_weight_loader)(self.engine.model, received)

    @handles_errors
    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        name = get_field(body, "group_name", str, "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return result_response(False, f"group {name!r} does not exist")
        await asyncio.to_thread(group.destroy)
        return result_response(True, f"Succeeded to destroy custom process group {name!r}.")

    @handles_errors
    async def weights_checksum(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        names = get_field(body, "names", list, None)
        self._require_weights_resident()
        checksums = await asyncio.to_thread(self._checksums, names)
        return web.json_response({"weight_version": self.weight_version, "checksums": checksums})

    def _checksums(self, names: list[str] | None) -> dict[str, str]:
        with self.engine.model_lock:
            params = model_tensors(self.engine.model)
            unknown = [n for n in names or [] if n not in params]
            if unknown:
                raise BadRequest(f"unknown parameter names {unknown[:5]}")
            return {n: tensor_checksum(params[n]) for n in (names if names is not None else params)}

    async def close(self) -> None:
        for group in self.groups.values():
            group.destroy()
        self.groups.clear()
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
    p = argparse.ArgumentParser(prog="python -m raygym.rollout.server", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint directory or builtin:tiny-qwen3")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (never 0.0.0.0 unless you mean it)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--custom-weight-loader", nargs="*", default=[], help="pkg.mod:fn loaders a load_format may name"
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
        help="torch intra-op threads; default 1 on CPU (spinning threads on a shared CPU cost far more than they give)",
    )
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.max_running_requests < 1:
        p.error(f"--max-running-requests {args.max_running_requests}: must be >= 1")
    return args


async def serve(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    threads = args.num_threads or (1 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    model, tokenizer, local_path = load_model(args.model_path, device, args.dtype)
    engine = GenerationEngine(
        model,
        eos_token_ids=sorted(eos_ids(model, tokenizer)),
        tokenizer=tokenizer,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        batch_wait_s=args.batch_wait_ms / 1000.0,
        pad_token_id=int(getattr(model.config, "pad_token_id", None) or 0),
    )
    server = InferenceServer(
        engine,
        model_path=args.model_path,
        tokenizer=tokenizer,
        weight_version=args.weight_version,
        loaders=WeightLoaders(args.custom_weight_loader),
        weight_update_timeout_s=args.weight_update_timeout,
    )
    engine.start()
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"raygym server ready on http://{args.host}:{args.port} (model {local_path}, {device})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

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
