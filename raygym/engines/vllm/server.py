"""raygym's adapter for vLLM: vLLM's engine in this process, raygym's engine protocol on HTTP.

Run by the interpreter where vLLM is installed, with raygym importable (the EngineActor arranges both)::

    RAYGYM_ENGINE_API_KEY=... python -m raygym.engines.vllm.server --model-path P --host 127.0.0.1 --port 30000 \\
        [--tensor-parallel-size 1] [--gpu-memory-utilization 0.75] [--max-model-len 4096] [--max-num-seqs 128] \\
        [--dtype auto] [--seed 0] [--weight-version 0] [--enable-sleep-mode] [--enforce-eager]

Why an adapter and not ``vllm serve``: vLLM's HTTP server speaks OpenAI's API (text in, text out); raygym's
rollout manager, EngineActor and weight sync speak SGLang's native API (:mod:`raygym.engine_api.protocol`: token
ids in, token ids and per-token log-probs out, pause/flush/abort, weight routes). vLLM's documented way to
embed its engine is ``AsyncLLM``, which this process runs (vLLM spawns its engine-core and worker processes
from here). Routes map onto vLLM's engine as follows:

- ``/generate`` -> ``AsyncLLM.generate`` per sample (read and answered by :mod:`raygym.engines.serving.generate_route`,
  as on raygym's server; :mod:`raygym.engines.vllm.protocol` translates the sampling parameters; ``stream: true``
  sends vLLM's cumulative outputs as they come); ``image_data`` on a Qwen2-VL-family checkpoint -> vLLM's
  ``multi_modal_data`` with one pad per image, which vLLM widens back to the request's ids
  (:mod:`raygym.engines.vllm.vision`);
- ``/pause_generation`` -> ``pause_generation`` (abort -> "abort", in_place -> "keep", retract -> "keep" plus
  a prefix-cache reset that preempts running requests, so they are recomputed after the update);
  ``/continue_generation`` -> ``resume_generation``; ``/flush_cache`` -> ``reset_prefix_cache`` (400 while
  requests hold KV blocks, as SGLang answers); ``/abort_request`` -> ``abort``;
- ``/release_memory_occupation`` / ``/resume_memory_occupation`` -> ``sleep(level=1)`` / ``wake_up(tags)``
  (memory is freed on GPU when launched with ``--enable-sleep-mode``; vLLM's CPU workers free nothing);
- weight routes -> vLLM's weight-transfer lifecycle with raygym's backend in the workers
  (:mod:`raygym.engines.vllm.weights`): ``/init_weights_update_group`` -> ``init_weight_transfer_engine``,
  ``/begin_weight_update`` / ``/end_weight_update`` -> ``start_weight_update`` / ``finish_weight_update``
  (an update sent outside a session gets one of its own), ``/update_weights_from_distributed``, ``_disk`` and
  ``_tensor`` -> ``update_weights`` with the chunk's description, ``/destroy_weights_update_group`` ->
  ``shutdown_weight_transfer_engine``; ``/raygym/weights_checksum`` answers the checksums of the HF-named
  tensors the workers loaded (:mod:`raygym.engines.vllm.verify`; the probe verifies the rest);
- LoRA (``--lora-rank R``): ``/load_lora_adapter`` / ``/unload_lora_adapter`` -> ``add_lora`` / ``remove_lora``
  of ``LoRARequest``\\s, and a request's ``lora_path`` picks one (:mod:`raygym.engines.vllm.lora`).

With an API key in ``RAYGYM_ENGINE_API_KEY`` every route but ``/health*`` requires it (the key never goes on a
command line); routes that change state take POST with a JSON body only (:mod:`raygym.engines.serving.http`).
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
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from raygym.engine_api import protocol
from raygym.engine_api.auth import engine_api_key
from raygym.engine_api.protocol import STATE_CHANGING, Endpoint, GenerateResponse
from raygym.engines.launch.vllm import cpu_dtype, cpu_engine_args, cpu_kv_cache_gib, model_facts
from raygym.engines.serving import generate_route as gr
from raygym.engines.serving.http import (
    BadRequest,
    guard_middleware,
    handles_errors,
    parse,
    ping,
    read_json,
    register_routes,
    result_response,
    server_info_body,
)
from raygym.engines.vllm import protocol as vp
from raygym.engines.vllm import vision as vv
from raygym.engines.vllm.idle import READER_SPIN_ENV

log = logging.getLogger("raygym.engines.vllm.server")
vv.install_stand_ins_from_env()  # vLLM's spawned processes import this module (their __mp_main__) before the model's

HEALTH_GENERATE_TIMEOUT_S = 20.0
WORKER_EXTENSION = "raygym.engines.vllm.weights.RaygymWorkerExtension"
RAYGYM_LOADERS = ("raygym.weightsync.loader.load_payload", "raygym.weightsync.loader:load_payload")
POINTER_LOADERS = ("raygym.weightsync.loader.load_payload_via_model", "raygym.weightsync.loader:load_payload_via_model")
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


class VllmAdapter:
    """The HTTP front of one ``AsyncLLM``: generation, control and weight routes (see the module docstring)."""

    def __init__(self, llm: Any, *, model_path: str, vocab_size: int, eos_token_id: int | None,
                 weight_version: str, device: str, sleep_mode: bool, timeout_s: float,
                 api_key: str | None = None, vision: vv.VllmVision | None = None) -> None:
        self.llm = llm
        self.vision = vision  # None: a text-only checkpoint
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.weight_version = str(weight_version)
        self.device = device
        self.sleep_mode = sleep_mode
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.released: set[str] = set()
        self._rids: dict[str, set[str]] = {}  # SGLang rid -> vLLM request ids
        self._weights = asyncio.Lock()  # weight requests run one at a time, in arrival order
        self._session = False  # a weight-update session is open
        self._session_failure = ""  # why a chunk of the open session failed
        self._version_before = self.weight_version  # what the session started from
        from raygym.engines.vllm.lora import VllmLora

        self.lora = VllmLora(llm)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30,
                              middlewares=[guard_middleware(self.api_key, frozenset(e.value for e in STATE_CHANGING))])
        register_routes(app.router, {
            Endpoint.GENERATE: self.generate, Endpoint.HEALTH: self.health,
            Endpoint.HEALTH_GENERATE: self.health_generate, Endpoint.MODEL_INFO: self.model_info,
            Endpoint.GET_MODEL_INFO: self.model_info, Endpoint.GET_WEIGHT_VERSION: self.get_weight_version,
            Endpoint.SERVER_INFO: self.server_info, Endpoint.GET_SERVER_INFO: self.server_info, Endpoint.PING: ping,
            Endpoint.WEIGHT_VERSION: self.get_weight_version, Endpoint.RAYGYM_STATS: self.stats,
            Endpoint.FLUSH_CACHE: self.flush_cache, Endpoint.PAUSE_GENERATION: self.pause_generation,
            Endpoint.CONTINUE_GENERATION: self.continue_generation, Endpoint.ABORT_REQUEST: self.abort_request,
            Endpoint.RELEASE_MEMORY: self.release_memory, Endpoint.RESUME_MEMORY: self.resume_memory,
            Endpoint.INIT_WEIGHTS_UPDATE_GROUP: self.init_weights_update_group,
            Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP: self.destroy_weights_update_group,
            Endpoint.BEGIN_WEIGHT_UPDATE: self.begin_weight_update, Endpoint.END_WEIGHT_UPDATE: self.end_weight_update,
            Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED: self.update_weights_from_distributed,
            Endpoint.UPDATE_WEIGHTS_FROM_DISK: self.update_weights_from_disk,
            Endpoint.UPDATE_WEIGHTS_FROM_TENSOR: self.update_weights_from_tensor,
            Endpoint.UPDATE_WEIGHT_VERSION: self.update_weight_version,
            Endpoint.RAYGYM_WEIGHTS_CHECKSUM: self.weights_checksum,
            Endpoint.LOAD_LORA_ADAPTER: self.lora.load_route, Endpoint.UNLOAD_LORA_ADAPTER: self.lora.unload_route,
        })
        return app

    # ----- generation -----
    @handles_errors
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, protocol.GenerateRequest)
        encode = self.llm.get_tokenizer().encode if req.text is not None else None
        try:
            call = gr.read_generate(req, vocab_size=self.vocab_size, encode=encode, parse_params=vp.sampling_kwargs)
            prompts = vv.vllm_prompts(self.vision, self.model_path, call.jobs)  # images: vLLM's form, or a 400
        except (gr.GenerateError, vv.ImageInputError) as exc:
            raise BadRequest(str(exc)) from None
        if any(job.routed_experts for job in call.jobs):
            raise BadRequest("return_routed_experts: raygym's vLLM adapter does not report routed experts")
        try:
            adapters = [self.lora.request_for(job.lora_path) for job in call.jobs]
        except KeyError as exc:
            raise BadRequest(f"lora_path={exc.args[0]!r}: no such adapter is loaded (loaded: "
                             f"{sorted(self.lora.requests)}); load it with /load_lora_adapter") from None
        return await gr.respond(request, call, [self._updates(job, adapter, call.stream, prompt)
                                             for job, adapter, prompt in zip(call.jobs, adapters, prompts, strict=True)])

    async def _updates(self, job: gr.SampleJob[dict[str, Any]], adapter: Any, stream: bool,
                       prompt: dict[str, Any] | None = None) -> AsyncIterator[GenerateResponse]:
        """One sample on vLLM's engine (``prompt``: ``TokensPrompt``'s fields, default the job's ids): with
        ``stream``, the sample so far at each of vLLM's outputs (cumulative), then its answer."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        request_id = f"{job.rid}-{job.sample}" if job.samples > 1 else job.rid
        params = SamplingParams(**job.params, logprobs=0 if job.logprob else None,
                                prompt_logprobs=0 if job.logprob and job.logprob_start >= 0 else None,
                                output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY)
        started = time.monotonic()
        self._rids.setdefault(job.rid, set()).add(request_id)
        final = None
        try:
            async for out in self.llm.generate(TokensPrompt(**(prompt or {"prompt_token_ids": list(job.prompt)})),
                                               params, request_id=request_id, lora_request=adapter):
                if job.images and final is None:
                    vv.check_widened(out.prompt_token_ids, job.prompt)
                final = out
                if stream and not out.finished and out.outputs:
                    yield self._answer(job, out, started, finished=False)
        finally:
            ids_of_rid = self._rids.get(job.rid)
            if ids_of_rid is not None:
                ids_of_rid.discard(request_id)
                if not ids_of_rid:
                    del self._rids[job.rid]
        if final is None or not final.outputs:
            yield gr.sample_answer(job, text="", output_ids=[], weight_version=self.weight_version,
                                finish=vp.finish_reason("abort", None, eos_token_id=None, completion_tokens=0,
                                                        message="aborted"),
                                output_logprobs=[], latency_s=time.monotonic() - started)
            return
        yield self._answer(job, final, started, finished=True)

    def _answer(self, job: gr.SampleJob[dict[str, Any]], out: Any, started: float, *, finished: bool
                ) -> GenerateResponse:
        """SGLang's answer from one of vLLM's ``RequestOutput``s (the sample so far unless ``finished``)."""
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        out_lp = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], tokens, strict=False)] \
            if job.logprob else None
        if out_lp is not None and len(out_lp) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(out_lp)} log-probs for {len(tokens)} tokens")
        prompt_lp = None
        if finished and out.prompt_logprobs is not None:
            prompt_lp = [None if step is None else float(step[tok].logprob)
                         for step, tok in zip(out.prompt_logprobs, job.prompt, strict=True)]
        finish = vp.finish_reason(comp.finish_reason, comp.stop_reason, eos_token_id=self.eos_token_id,
                                  completion_tokens=len(tokens), message="aborted") if finished else None
        return gr.sample_answer(job, text=comp.text, output_ids=tokens, finish=finish, weight_version=self.weight_version,
                             output_logprobs=out_lp, prompt_logprobs=prompt_lp,
                             cached_tokens=int(out.num_cached_tokens or 0), latency_s=time.monotonic() - started)

    # ----- health and info -----
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if not self.llm.errored else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """One greedy token through the model; 503 when asleep, released or no token came in
        ``HEALTH_GENERATE_TIMEOUT_S``. While generation is paused (a weight update) the probe waits in line, as on
        SGLang: a pause is the trainer's doing, not a sign that the server is broken."""
        if self.llm.errored or self.released or await self.llm.is_sleeping():
            return _unhealthy("the engine errored, released its memory or sleeps")
        job = gr.SampleJob(0, f"HEALTH_CHECK_{uuid.uuid4().hex}", 0, 1, [0],
                        {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}, False, -1, None, False)
        try:
            answer = await asyncio.wait_for(gr.last(self._updates(job, None, False)), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _unhealthy(f"no token in {HEALTH_GENERATE_TIMEOUT_S:.0f} s")
        except RuntimeError as exc:
            return _unhealthy(f"{type(exc).__name__}: {exc}")
        # A probe a pause aborted was still answered by the scheduler: healthy, as SGLang counts any answer.
        if answer.finish_type == "abort" and (self.released or await self.llm.is_sleeping()):
            return _unhealthy("the probe was aborted and the engine released its memory")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        import vllm

        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "has_image_understanding": self.vision is not None and self.vision.unsupported is None,
            "has_audio_understanding": False, "engine": "vllm",
            "vllm_version": vllm.__version__, "device": self.device,
            "dtype": str(self.llm.model_config.dtype).removeprefix("torch."),
            "max_model_len": self.llm.model_config.max_model_len,
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/server_info`` for the vLLM engine behind this adapter."""
        model_len = int(self.llm.model_config.max_model_len)
        running = sum(len(ids) for ids in self._rids.values())
        return web.json_response(server_info_body(
            model_path=self.model_path, context_length=model_len,
            max_running_requests=int(self.llm.vllm_config.scheduler_config.max_num_seqs), device=self.device,
            weight_version=self.weight_version, running=running))

    async def stats(self, request: web.Request) -> web.Response:
        """``{"running": requests in flight, "paused", "sleeping", "released", "weight_version"}``."""
        return web.json_response({
            "running": sum(len(ids) for ids in self._rids.values()), "paused": await self.llm.is_paused(),
            "sleeping": await self.llm.is_sleeping(), "released": sorted(self.released),
            "weight_version": self.weight_version})

    # ----- pause, flush, abort -----
    @handles_errors
    async def pause_generation(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.PauseGeneration, required=False)
        mode = PAUSE_MODES[req.mode]
        await self.llm.pause_generation(mode=mode, clear_cache=req.mode == "abort")
        if req.mode == "retract":  # drop the KV of kept requests: they are recomputed after the update
            await self.llm.reset_prefix_cache(reset_running_requests=True)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @handles_errors
    async def continue_generation(self, request: web.Request) -> web.Response:
        await parse(request, protocol.ContinueGeneration, required=False)
        if self.released == {"kv_cache"}:
            # Colocated: the weights are back and the sync wants to generate (its probe) before the driver
            # resumes the KV cache; vLLM's scheduler may only run with all of its memory resident.
            await self._wake(["kv_cache"])
        await self.llm.resume_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self.llm.reset_prefix_cache()
        return web.Response(text="Cache flushed.\n" if ok else "Flush cache failed: requests hold the KV cache.\n",
                            status=200 if ok else 400)

    @handles_errors
    async def abort_request(self, request: web.Request) -> web.Response:
        """Abort one request by ``rid`` or every one; an empty ``rid`` without ``abort_all`` does nothing."""
        req = await parse(request, protocol.AbortRequest, required=False)
        if req.abort_all:
            targets = [i for ids in self._rids.values() for i in ids]
        else:
            targets = sorted(self._rids.get(req.rid or "", ()))
        if targets:
            await self.llm.abort(targets)
        return web.Response(status=200)

    # ----- memory -----
    @handles_errors
    async def release_memory(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.MemoryTags, required=False)
        tags = set(req.tags or ("weights", "kv_cache")) - {"cuda_graph"}
        if tags and not self.released:
            await self.llm.sleep(level=1, mode="abort")  # weights to host, KV cache discarded (on GPU)
            self.released = {"weights", "kv_cache"}
        return web.json_response(None)

    @handles_errors
    async def resume_memory(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.MemoryTags, required=False)
        await self._wake(list(set(req.tags or ("weights", "kv_cache")) - {"cuda_graph"}))
        return web.json_response(None)

    async def _wake(self, tags: list[str]) -> None:
        wanted = sorted(self.released & set(tags))
        if wanted:
            await self.llm.wake_up(tags=wanted)
            self.released -= set(wanted)

    # ----- weights -----
    @handles_errors
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        req = await parse(request, protocol.InitWeightsUpdateGroup)
        if req.rank_offset == 0 or req.rank_offset >= req.world_size:
            raise BadRequest(f"rank_offset={req.rank_offset}: must be in [1, world_size={req.world_size}); rank 0 "
                             "is the sender")
        info = {**req.model_dump(), "timeout_s": self.timeout_s}
        async with self._weights:
            try:
                await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
            except Exception as exc:
                return _fail(f"Failed to init group {req.group_name!r}: {_why(exc)}")
        return _ok(f"Succeeded to initialize custom process group {req.group_name!r}.")

    @handles_errors
    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        await parse(request, protocol.DestroyWeightsUpdateGroup, required=False)
        async with self._weights:
            try:
                await self.llm.shutdown_weight_transfer_engine()
            except Exception as exc:
                return _fail(f"Failed to destroy the weight-update group: {_why(exc)}")
        return _ok("Succeeded to destroy the weight-update group.")

    @handles_errors
    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await parse(request, protocol.BeginWeightUpdate, required=False)
        async with self._weights:
            if self._session:
                return _fail("a weight-update session is already open; call /end_weight_update first")
            await self.llm.start_weight_update()
            self._session, self._session_failure, self._version_before = True, "", self.weight_version
        return _ok("Success")

    @handles_errors
    async def end_weight_update(self, request: web.Request) -> web.Response:
        await read_json(request, required=False)
        async with self._weights:
            if not self._session:
                return _fail("no weight-update session is open; call /begin_weight_update first")
            return result_response(await self._finish())

    async def _finish(self) -> dict[str, Any]:
        """Close the session. The served version label moved with each chunk that loaded (SGLang's rule, which
        the sync coordinator reads before the session ends); after a failed chunk it is the one from before."""
        failure = self._session_failure
        self._session, self._session_failure = False, ""
        await self.llm.finish_weight_update(weight_version=None if failure else self.weight_version)
        if failure:  # reported on the chunk that failed; the session closes so a full resync can follow
            return {"success": True, "message": f"session closed; nothing of it is served ({failure})"}
        return {"success": True, "message": f"Weight version updated to {self.weight_version}."}

    @handles_errors
    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromDistributed)
        if req.load_format == protocol.FLATTENED_BUCKET:
            payload = "flattened"
        elif req.load_format in RAYGYM_LOADERS:
            payload = "raygym"
        elif req.load_format in (None, "", "auto"):
            payload = "tensors"
        else:
            raise BadRequest(f"load_format={req.load_format!r}: vLLM's adapter takes 'flattened_bucket', raygym "
                             f"buckets ({RAYGYM_LOADERS[0]}) or none (one broadcast per tensor)")
        info = {"source": "group", "payload": payload, "group_name": req.group_name, "names": req.names,
                "dtypes": req.dtypes, "shapes": req.shapes}
        return result_response(await self._update(info, req))

    @handles_errors
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromDisk)
        if req.load_format in RAYGYM_LOADERS:
            payload = "raygym"
        elif req.load_format in (None, "", "auto", "safetensors"):
            payload = "tensors"
        else:
            raise BadRequest(f"load_format={req.load_format!r}: vLLM's adapter reads HF safetensors directories "
                             f"(no load_format) or raygym version directories ({RAYGYM_LOADERS[0]})")
        return result_response(await self._update({"source": "disk", "payload": payload, "url": req.model_path}, req))

    @handles_errors
    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightsFromTensor)
        if not req.serialized_named_tensors:
            raise BadRequest("serialized_named_tensors is empty: one entry per TP rank is expected")
        if req.load_format in POINTER_LOADERS:  # raygym's disk transport: a pointer to a version directory
            from raygym.weightsync.tensor_pickle import POINTER_NAME, loads_named_tensors

            named = loads_named_tensors(req.serialized_named_tensors[0])
            if len(named) != 1 or named[0][0] != POINTER_NAME:
                raise BadRequest(f"load_format={req.load_format!r} takes one {POINTER_NAME} tensor")
            pointer = json.loads(bytes(named[0][1].numpy().tobytes()).decode())
            info = {"source": "disk", "payload": "raygym", "url": str(pointer["url"]),
                    "ack_engine": int(pointer["engine"]), "version": str(pointer.get("version", ""))}
        elif req.load_format in (None, "", "auto"):
            info = {"source": "tensors", "payload": "tensors", "serialized": req.serialized_named_tensors}
        else:
            raise BadRequest(f"load_format={req.load_format!r}: not a loader vLLM's adapter knows")
        return result_response(await self._update(info, req))

    async def _update(self, info: dict[str, Any], req: Any) -> dict[str, Any]:
        """One chunk through vLLM's ``update_weights`` (inside the open session, or one of its own)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if self.released & {"weights"}:
            raise BadRequest("weights are released; call /resume_memory_occupation with tags ['weights'] first")
        if req.abort_all_requests:
            targets = [i for ids in self._rids.values() for i in ids]
            if targets:
                await self.llm.abort(targets)
        async with self._weights:
            own = not self._session
            if own:
                await self.llm.start_weight_update()
                self._session, self._session_failure, self._version_before = True, "", self.weight_version
            failure = ""
            try:
                await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
                failure = "; ".join(f for f in await self.llm.collective_rpc("raygym_take_failure") if f)
            except Exception as exc:
                failure = _why(exc)
            if failure:
                self._session_failure = self._session_failure or failure
                self.weight_version = self._version_before
            elif req.weight_version is not None and not self._session_failure:
                self.weight_version = req.weight_version
            finished = await self._finish() if own else None
        if failure:
            return {"success": False, "message": f"Failed to update weights: {failure}; the served weights and "
                                                 f"weight_version {self.weight_version!r} stay as they were "
                                                 "until a full update succeeds", "num_paused_requests": 0}
        return {"success": True, "num_paused_requests": 0,
                "message": finished["message"] if finished else "Succeeded to receive the weights (session open)."}

    @handles_errors
    async def weights_checksum(self, request: web.Request) -> web.Response:
        from raygym.engines.vllm.verify import received_checksums

        req = await parse(request, protocol.WeightsChecksum, required=False)
        if req.shadow:
            raise BadRequest("shadow=true: vLLM's adapter loads no shadow copy")
        return web.json_response(await received_checksums(self.llm, req.names, self.weight_version))

    @handles_errors
    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = await parse(request, protocol.UpdateWeightVersion)
        self.weight_version = req.new_version
        await self.llm.update_weight_version(self.weight_version)
        return web.json_response({"success": True, "message": f"Weight version updated to {req.new_version}",
                                  "new_version": self.weight_version})


def _unhealthy(reason: str) -> web.Response:
    """A failed ``/health_generate``, with its reason in the engine's log and in the answer."""
    log.warning("/health_generate: unhealthy: %s", reason)
    return web.Response(status=503, text=reason + "\n")


def _ok(message: str) -> web.Response:
    return result_response({"success": True, "message": message})


def _fail(message: str) -> web.Response:
    return result_response({"success": False, "message": message})


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:1000]}"


# --------------------------------------------------------------------------- start-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m raygym.engines.vllm.server",
                                description="raygym's engine protocol in front of vLLM's engine")
    p.add_argument("--model-path", required=True, help="HF checkpoint directory or builtin:tiny-qwen3")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.75)
    p.add_argument("--max-model-len", type=int, default=None, help="clamped to the model's context length")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="auto: vLLM's choice, but float32 checkpoints stay float32 on "
                   "CPUs without bf16 instructions (see cpu_dtype)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-sleep-mode", action="store_true", help="GPU: let release/resume free memory")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--weight-update-timeout", type=float, default=600.0)
    p.add_argument("--engine-args", default="{}", help="JSON object of further vLLM engine arguments")
    p.add_argument("--lora-rank", type=int, default=0, help="serve LoRA adapters of this rank (0: none)")
    p.add_argument("--lora-adapter", default=None, help="a PEFT adapter directory served from the start (needs "
                   "--lora-rank) as raygym.lora.ADAPTER_NAME")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from raygym.builtin import is_builtin, materialize_model

    model_path = args.model_path
    if is_builtin(model_path):
        model_path = materialize_model(model_path, tempfile.mkdtemp(prefix="raygym-model-"))
    facts = model_facts(model_path)
    max_len = args.max_model_len
    if facts["max_position_embeddings"]:
        max_len = min(max_len or facts["max_position_embeddings"], facts["max_position_embeddings"])

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    device = "cpu" if current_platform.is_cpu() else "cuda"
    dtype = args.dtype
    if device == "cpu":
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        dtype = cpu_dtype(args.dtype, facts["dtype"], flags)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib(
            facts["kv_bytes_per_token"], args.max_num_seqs, max_len or 4096)))
        # the workers' batch-queue spin after each batch takes a core the trainer needs (raygym.engines.vllm.idle)
        os.environ.setdefault(READER_SPIN_ENV, "0.05")
    from raygym.engines.vllm.lora import lora_engine_args

    lora_args = lora_engine_args(args.lora_rank) if args.lora_rank > 0 else {}
    extra_engine_args = json.loads(args.engine_args)
    if device == "cpu":
        extra_engine_args = cpu_engine_args(extra_engine_args)
    vision, tokenizer_path, extra_engine_args = vv.prepare_vision(model_path, extra_engine_args)
    engine_args = AsyncEngineArgs(
        model=model_path, tokenizer=tokenizer_path, dtype=dtype, seed=args.seed, max_model_len=max_len,
        tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager or device == "cpu",
        enable_sleep_mode=args.enable_sleep_mode and device == "cuda", logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": "raygym"},
        disable_log_stats=True, **lora_args, **extra_engine_args)
    llm = AsyncLLM.from_engine_args(engine_args)
    tokenizer = llm.get_tokenizer()
    adapter = VllmAdapter(
        llm, model_path=model_path, vocab_size=facts["vocab_size"], eos_token_id=getattr(tokenizer, "eos_token_id", None),
        weight_version=args.weight_version, device=device, sleep_mode=args.enable_sleep_mode,
        timeout_s=args.weight_update_timeout, api_key=engine_api_key(), vision=vision)
    if args.lora_adapter:
        from raygym.lora import ADAPTER_NAME

        await adapter.lora.load(ADAPTER_NAME, args.lora_adapter)
    runner = web.AppRunner(adapter.app(), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"raygym vLLM adapter ready on http://{args.host}:{args.port} (model {model_path}, {device})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asyncio.run(serve(args))


if __name__ == "__main__":  # vLLM spawns its engine-core process: nothing may run on import
    main()
