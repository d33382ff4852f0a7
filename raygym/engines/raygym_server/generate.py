"""``/generate`` on raygym's server: requests read by :mod:`raygym.engines.serving.generate_route` (shared with the vLLM
adapter), admitted against the server's limits, run on its :class:`~raygym.engines.raygym_server.generation.GenerationEngine`,
answered whole or streamed.

Streaming: every request of a ``stream: true`` call tells the HTTP loop when its decode steps added tokens
(``GenerationRequest.on_token``; one wake-up per loop turn however many tokens came), and each wake-up sends
the sample so far: cumulative tokens, log-probs and text (without an end that may still turn into a stop
string), ``finish_reason`` null until the last update, which is the whole answer. A client that goes away
cancels its requests within a decode step.

Images: SGLang's ``image_data`` (one prompt's images, or a list per prompt of a batch) go to a vision-language
model with prompts whose image pads are already expanded; they are decoded and processed once per prompt
(:meth:`GenerationEngine.prepare_images`), and a request that cannot be served (images for a text-only model,
an unreadable image, a pad count that does not match) is answered 400 before anything is queued.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from raygym import routed_experts
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.engines.raygym_server.generation import (
    EngineBusy,
    EngineUnavailable,
    GenerationEngine,
    GenerationRequest,
)
from raygym.engines.raygym_server.routing_capture import answer_routes
from raygym.engines.raygym_server.sampling import SamplingParams
from raygym.engines.raygym_server.vision_inputs import ImageInputs
from raygym.engines.serving.generate_route import (
    GenerateCall,
    GenerateError,
    SampleJob,
    images_per_prompt,
    read_generate,
    respond,
    sample_answer,
    visible_text,
)
from raygym.engines.serving.http import BadRequest, handles_errors, parse
from raygym.routed_experts import SERVER_FLAG


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and what the server holds at once (server flags)."""

    context_length: int  # prompt + max_new_tokens, in tokens (the model's max_position_embeddings by default)
    max_n: int = 128  # samples per prompt
    max_queued_requests: int = 4096  # sequences waiting to run; more -> 503
    max_body_bytes: int = 64 << 20  # request body; more -> 413


class Wakeup:
    """Wakes the HTTP loop from the generation thread: many calls before the loop runs make one wake-up. It
    remembers how many tokens the request had at the first call since :meth:`take_mark`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self._scheduled = False
        self._mark: int | None = None

    def __call__(self, request: GenerationRequest) -> None:
        if self._mark is None:
            self._mark = len(request.output_versions)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._wake)

    def take_mark(self) -> int | None:
        mark, self._mark = self._mark, None
        return mark

    def _wake(self) -> None:
        self._scheduled = False
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


def _parse_params(raw: dict[str, Any]) -> tuple[SamplingParams, int]:
    params = SamplingParams.from_dict(raw)
    return params, params.n


class GenerateRoute:
    """``/generate`` of one :class:`GenerationEngine` (``weight_version()``: the label answers carry)."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, limits: Limits, check_lora: Callable[[Any], None],
                 weight_version: Callable[[], str]) -> None:
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        self.check_lora, self.weight_version = check_lora, weight_version

    @handles_errors
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, GenerateRequest)
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        try:
            call = read_generate(req, vocab_size=self.engine.vocab_size, encode=encode, parse_params=_parse_params)
            firsts = [job for job in call.jobs if job.sample == 0]  # one per prompt, in order
            image_lists = images_per_prompt(req.image_data, len(firsts), call.single)
        except GenerateError as exc:
            raise BadRequest(str(exc)) from None
        self.check_lora(req.lora_path)
        if any(job.routed_experts for job in call.jobs) and self.engine.routing is None:
            raise BadRequest(f"return_routed_experts: start the server with {SERVER_FLAG} (a MoE model) to get them")
        self._admit(call)
        images = await self._prepare_images([job.prompt for job in firsts], image_lists)
        # each job's prompt: a prompt's samples are consecutive, its first (sample 0) leading
        prompt_of = [count - 1 for count in itertools.accumulate(job.sample == 0 for job in call.jobs)]
        loop = asyncio.get_running_loop()
        wakeups = [Wakeup(loop) for _ in call.jobs]
        requests = [GenerationRequest(rid=job.rid, input_ids=job.prompt, params=job.params, on_done=wake,
                                      on_token=wake if call.stream else None, return_routed_experts=job.routed_experts,
                                      images=images[prompt])
                    for job, wake, prompt in zip(call.jobs, wakeups, prompt_of, strict=True)]
        try:
            self.engine.submit_all(requests)
        except EngineBusy as exc:
            raise BadRequest(str(exc), 503) from None
        except EngineUnavailable as exc:
            raise BadRequest(str(exc)) from None
        started = time.monotonic()
        return await respond(request, call, [self._updates(call, job, r, wake, started)
                                             for job, r, wake in zip(call.jobs, requests, wakeups, strict=True)])

    async def _prepare_images(self, prompts: Sequence[list[int]], image_lists: list[list[str]]
                              ) -> list[ImageInputs | None]:
        """Each prompt's images, decoded and processed off the HTTP loop (400 naming the prompt when one cannot
        be served). Text prompts of a text-only model cost nothing here."""
        if self.engine.vision is None and not any(image_lists):
            return [None] * len(prompts)

        def prepare() -> list[ImageInputs | None]:
            out: list[ImageInputs | None] = []
            for i, (ids, refs) in enumerate(zip(prompts, image_lists, strict=True)):
                try:
                    out.append(self.engine.prepare_images(ids, refs))
                except ValueError as exc:
                    raise BadRequest(f"prompt {i}: {exc}" if len(prompts) > 1 else str(exc)) from None
            return out

        return await asyncio.to_thread(prepare)

    def _admit(self, call: GenerateCall[SamplingParams]) -> None:
        """Refuse, before anything is queued, what cannot be served: too many samples, prompts that do not
        fit the context with their ``max_new_tokens`` (SGLang's rule and wording)."""
        context = self.limits.context_length
        firsts = [job for job in call.jobs if job.sample == 0]
        for i, job in enumerate(firsts):
            ids, p = job.prompt, job.params
            where = f"prompt {i}: " if len(firsts) > 1 else ""
            if p.n > self.limits.max_n:
                raise BadRequest(f"{where}sampling_params.n={p.n}: at most {self.limits.max_n} samples per prompt "
                                 "(--max-n)")
            if len(ids) >= context:
                raise BadRequest(f"{where}The input ({len(ids)} tokens) is longer than the model's context length "
                                 f"({context} tokens).")
            if len(ids) + p.max_new_tokens > context:
                raise BadRequest(
                    f"{where}Requested token count exceeds the model's maximum context length of {context} tokens. "
                    f"You requested a total of {len(ids) + p.max_new_tokens} tokens: {len(ids)} tokens from the "
                    f"input messages and {p.max_new_tokens} tokens for the completion (sampling_params.max_new_tokens)."
                )
        if len(call.jobs) > self.limits.max_queued_requests:
            raise BadRequest(f"{len(call.jobs)} samples in one request: more than the queue holds "
                             f"(--max-queued-requests {self.limits.max_queued_requests})")

    async def _updates(self, call: GenerateCall[SamplingParams], job: SampleJob[SamplingParams], r: GenerationRequest,
                       wake: Wakeup, started: float) -> AsyncIterator[GenerateResponse]:
        """The sample so far at every wake-up (streams only; the first update holds the first token alone, sent as
        soon as it exists, later ones all tokens decoded by then), then its answer; a consumer that stops early
        (the client went away) cancels the request."""
        try:
            sent = 0
            while True:
                if not r.done:
                    await wake.wait()
                mark = wake.take_mark()
                if call.stream and mark is not None:
                    upto = mark if sent == 0 else len(r.output_versions)
                    if upto > sent and not (r.done and upto >= len(r.output_ids)):  # else the answer says it all
                        yield self._partial(job, r, upto)
                        sent = upto
                if r.done:
                    break
            yield await self._final(job, r, call.text_in_logprobs, time.monotonic() - started)
        finally:
            if not r.done:  # free its slot within a decode step
                self.engine.cancel([r], "the client disconnected")

    def _partial(self, job: SampleJob[SamplingParams], r: GenerationRequest, count: int) -> GenerateResponse:
        """The first ``count`` tokens (at most those whose version is recorded, appended last of the three)."""
        count = min(count, len(r.output_versions))
        ids = r.output_ids[:count]
        text = visible_text(self._decode(ids, job.params.skip_special_tokens), job.params.stop)
        return sample_answer(job, text=text, output_ids=ids, finish=None, weight_version=self.weight_version(),
                             output_logprobs=r.output_logprobs[:count], output_versions=r.output_versions[:count])

    async def _final(self, job: SampleJob[SamplingParams], r: GenerationRequest, with_text: bool,
                     latency: float) -> GenerateResponse:
        extra: dict[str, Any] = {}
        if r.return_routed_experts:  # SGLang's form (raygym/routed_experts.py)
            extra[routed_experts.META_KEY] = routed_experts.encode(answer_routes(r).numpy())
        prompt_logprobs = None
        if job.logprob and job.logprob_start >= 0:
            prompt_logprobs = [None, *(await asyncio.to_thread(self.engine.score, r.input_ids, r.images))]
        return sample_answer(
            job, text=self._text(r), output_ids=r.output_ids,
            finish=r.finish_reason or {"type": "abort", "message": "unfinished"}, weight_version=self.weight_version(),
            output_logprobs=r.output_logprobs,
            output_texts=[self._decode([t], False) for t in r.output_ids] if with_text and job.logprob else None,
            prompt_logprobs=prompt_logprobs,
            prompt_texts=[self._decode([t], False) for t in r.input_ids] if with_text and job.logprob else None,
            output_versions=r.output_versions, latency_s=latency, extra_meta=extra)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    def _text(self, r: GenerationRequest) -> str:
        p, reason = r.params, r.finish_reason or {}
        ids = r.output_ids
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim:
            ids = ids[:-1]
        text = self._decode(ids, p.skip_special_tokens)
        matched = reason.get("matched")
        if isinstance(matched, str) and not p.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text
