"""``/generate`` written once for raygym's two servers: raygym's own (:mod:`raygym.engines.raygym_server.server`) and its vLLM
adapter (:mod:`raygym.engines.vllm.server`).

A :class:`~raygym.engine_api.protocol.GenerateRequest` is read into one :class:`SampleJob` per sample
(:func:`read_generate`: prompts as token ids, SGLang's one-value-or-one-per-prompt fields, ``n`` samples per
prompt); each server runs its jobs its own way and reports each as an async iterator of answers so far
(:func:`sample_answer`: a :class:`~raygym.engine_api.protocol.GenerateResponse`, so both servers answer in the
protocol's own model); :func:`respond` answers with the
last of each (one object for one prompt and sample, else a list), or, with ``stream: true``, streams every
update as a server-sent event (``index`` = the sample's place in the answer) and ends with ``data: [DONE]``
(:mod:`raygym.engine_api.protocol` describes the form).

>>> from raygym.engine_api.protocol import GenerateRequest
>>> call = read_generate(GenerateRequest(input_ids=[[3, 4], [5]], sampling_params={"n": 2}), vocab_size=10,
...                      encode=None, parse_params=lambda p: (p, p.get("n", 1)))
>>> [(job.index, job.prompt, job.sample) for job in call.jobs], call.single
([(0, [3, 4], 0), (1, [3, 4], 1), (2, [5], 0), (3, [5], 1)], False)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web

from raygym.engine_api.protocol import STREAM_DONE, GenerateRequest, GenerateResponse, stream_frame

P = TypeVar("P")
Answer = GenerateResponse


class GenerateError(ValueError):
    """A ``/generate`` request that cannot be served as sent (HTTP 400 with this message)."""


@dataclass(frozen=True)
class SampleJob(Generic[P]):
    """One sample to generate: the ``sample``-th of ``samples`` for prompt ``rid``, ``index``-th in the answer."""

    index: int
    rid: str
    sample: int
    samples: int
    prompt: list[int]
    params: P  # the server's own sampling parameters
    logprob: bool
    logprob_start: int  # -1: no input log-probs
    lora_path: str | None
    routed_experts: bool
    images: tuple[Any, ...] = ()  # the prompt's images (``image_data``: data URLs, paths, ...), shared by its samples


@dataclass(frozen=True)
class GenerateCall(Generic[P]):
    """A read ``/generate``: its jobs in answer order, and how to answer."""

    jobs: list[SampleJob[P]]
    single: bool  # one prompt sent as one (not a list): one sample is answered as an object
    stream: bool
    text_in_logprobs: bool


def per_item(value: Any, count: int, name: str, kind: type, default: Any) -> list[Any]:
    """SGLang's batch convention: one value for every prompt, or a list with one per prompt.

    >>> per_item(None, 2, "rid", str, None), per_item(True, 2, "return_logprob", bool, False)
    ([None, None], [True, True])
    """
    if value is None:
        return [default] * count
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return [value] * count
    if isinstance(value, list) and len(value) == count and all(
            isinstance(v, kind) and not (kind is int and isinstance(v, bool)) for v in value):
        return list(value)
    raise GenerateError(f"{name}: must be one {kind.__name__} or a list of {count} of them (one per prompt)")


def prompt_batch(input_ids: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    """``(prompts, single)`` from ``input_ids`` (a list of ints, or a list of such lists); an error when a
    prompt is empty or holds an id outside the vocabulary.

    >>> prompt_batch([3, 4], 50), prompt_batch([[3], [4, 5]], 50)
    (([[3, 4]], True), ([[3], [4, 5]], False))
    """
    single = not input_ids or not isinstance(input_ids[0], list)
    batch = [input_ids] if single else input_ids
    for row in batch:
        if not row:
            raise GenerateError("'input_ids' must be a non-empty list of ints or a list of such lists")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in row):
            raise GenerateError(f"'input_ids' must hold ints in [0, {vocab_size}) (the model's vocab_size)")
    return batch, single


def _prompts(req: GenerateRequest, vocab_size: int, encode: Callable[[str], list[int]] | None
             ) -> tuple[list[list[int]], bool]:
    if (req.input_ids is None) == (req.text is None):
        raise GenerateError("send exactly one of 'input_ids' (token ids) or 'text'")
    if req.text is None:
        return prompt_batch(req.input_ids, vocab_size)
    if encode is None:
        raise GenerateError("this model has no tokenizer; send 'input_ids' instead of 'text'")
    texts = [req.text] if isinstance(req.text, str) else req.text
    if not texts or any(t == "" for t in texts):
        raise GenerateError("'text' must be a non-empty string or a non-empty list of non-empty strings")
    encoded = [list(encode(t)) for t in texts]
    if any(not ids for ids in encoded):
        raise GenerateError("'text' encodes to no tokens; send text the tokenizer turns into at least one token")
    return encoded, isinstance(req.text, str)


def images_per_prompt(image_data: str | list[Any] | None, prompts: int, single: bool) -> list[list[str]]:
    """SGLang's ``image_data`` as one list of images per prompt: for one prompt (sent as one) an image or a
    list of them; for a batch a list with one entry per prompt, each an image, a list of images or ``[]``.

    >>> images_per_prompt("a", 1, True), images_per_prompt(["a", "b"], 1, True), images_per_prompt(None, 2, False)
    ([['a']], [['a', 'b']], [[], []])
    >>> images_per_prompt(["a", ["b", "c"], []], 3, False)
    [['a'], ['b', 'c'], []]
    """
    if image_data is None:
        return [[] for _ in range(prompts)]
    if single:
        if isinstance(image_data, str):
            return [[image_data]]
        if len(image_data) == 1 and isinstance(image_data[0], list):  # a batch of one, written as a batch
            image_data = image_data[0]
        if all(isinstance(i, str) for i in image_data):
            return [list(image_data)]
        raise GenerateError("image_data: one prompt takes an image (a string) or a list of images")
    if not isinstance(image_data, list) or len(image_data) != prompts:
        count = len(image_data) if isinstance(image_data, list) else "one image"
        raise GenerateError(f"image_data: {count} for {prompts} prompts; a batch takes a list with one entry per "
                            "prompt (an image, a list of images, or [] for none)")
    return [[entry] if isinstance(entry, str) else list(entry) for entry in image_data]


def read_generate(req: GenerateRequest, *, vocab_size: int, encode: Callable[[str], list[int]] | None,
                  parse_params: Callable[[dict[str, Any]], tuple[P, int]]) -> GenerateCall[P]:
    """The jobs of ``req``. ``parse_params`` turns one prompt's ``sampling_params`` into the server's own
    parameters and their ``n`` (a ValueError names the bad field); ``encode`` tokenizes ``text`` prompts. Each job
    carries its prompt's images (:func:`images_per_prompt`; the prompt ids arrive widened, see
    :class:`~raygym.engine_api.protocol.GenerateRequest`): a server that runs no images must refuse jobs that
    have some, never drop them."""
    prompts, single = _prompts(req, vocab_size, encode)
    count = len(prompts)
    images = images_per_prompt(req.image_data, count, single)
    params = per_item(req.sampling_params, count, "sampling_params", dict, {})
    rids = per_item(req.rid, count, "rid", str, None)
    logprobs = per_item(req.return_logprob, count, "return_logprob", bool, False)
    starts = per_item(req.logprob_start_len, count, "logprob_start_len", int, -1)
    routes = per_item(req.return_routed_experts, count, "return_routed_experts", bool, False)
    adapters = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path] * count
    if len(adapters) != count:
        raise GenerateError(f"lora_path: {len(adapters)} entries for {count} prompts")
    try:
        parsed = [parse_params(p) for p in params]
    except GenerateError:
        raise
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    jobs: list[SampleJob[P]] = []
    for i, ids in enumerate(prompts):
        rid = rids[i] or uuid.uuid4().hex
        own, n = parsed[i]
        for k in range(n):
            jobs.append(SampleJob(len(jobs), rid, k, n, ids, own, logprobs[i], starts[i], adapters[i], routes[i],
                                  tuple(images[i])))
    return GenerateCall(jobs, single, req.stream, req.return_text_in_logprobs)


def sample_answer(job: SampleJob[Any], *, text: str, output_ids: Sequence[int], finish: dict[str, Any] | None,
                  weight_version: str, output_logprobs: Sequence[float] | None = None,
                  output_texts: Sequence[str | None] | None = None,
                  prompt_logprobs: Sequence[float | None] | None = None,
                  prompt_texts: Sequence[str | None] | None = None, output_versions: Sequence[str] | None = None,
                  cached_tokens: int = 0, latency_s: float = 0.0, extra_meta: dict[str, Any] | None = None) -> Answer:
    """One sample's answer (:class:`raygym.engine_api.protocol.GenerateResponse`, SGLang's form); ``finish`` None:
    the sample so far, in a stream.

    ``output_logprobs``: the generated tokens' log-probs, reported when the job asked for them;
    ``prompt_logprobs``: one per prompt token (the first None), reported from ``logprob_start_len`` on;
    ``*_texts``: each token's text (``return_text_in_logprobs``), else None.

    >>> job = SampleJob(0, "r", 0, 1, [3, 4], {}, True, 0, None, False)
    >>> a = sample_answer(job, text="x", output_ids=[5], finish={"type": "length", "length": 1},
    ...                   weight_version="2", output_logprobs=[-0.5], prompt_logprobs=[None, -1.0])
    >>> a["meta_info"]["output_token_logprobs"], a["meta_info"]["input_token_logprobs"]
    ([[-0.5, 5, None]], [[None, 3, None], [-1.0, 4, None]])
    """
    meta: dict[str, Any] = {
        "id": job.rid, "finish_reason": finish, "prompt_tokens": len(job.prompt), "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens, "weight_version": weight_version, "e2e_latency": latency_s,
    }
    if output_versions is not None:  # raygym's server: the weight version of each output token
        meta["output_token_weight_versions"] = list(output_versions)
    if job.logprob:
        values = list(output_logprobs or [])
        if len(values) != len(output_ids):
            raise ValueError(f"{len(values)} log-probs for {len(output_ids)} output tokens")
        texts = output_texts or [None] * len(values)
        meta["output_token_logprobs"] = [[lp, tok, t] for lp, tok, t in zip(values, output_ids, texts, strict=True)]
        meta["input_token_logprobs"] = []
        if prompt_logprobs is not None and job.logprob_start >= 0:
            names = prompt_texts or [None] * len(job.prompt)
            meta["input_token_logprobs"] = [[prompt_logprobs[i], job.prompt[i], names[i]]
                                            for i in range(min(job.logprob_start, len(job.prompt)), len(job.prompt))]
    meta.update(extra_meta or {})
    return GenerateResponse.model_validate({"text": text, "output_ids": list(output_ids), "meta_info": meta})


def answer_json(answer: Answer, index: int | None = None) -> bytes:
    """The JSON of an answer as sent: the fields it was given (``index``: its row, in a stream)."""
    if index is not None:
        answer = answer.model_copy(update={"index": index})
    return answer.model_dump_json(exclude_unset=True).encode()


def visible_text(text: str, stops: Sequence[str]) -> str:
    """The part of a running sample's ``text`` a stream may show: without an end that may still become a stop
    string (the finished answer cuts it) or an unfinished UTF-8 character, so each update's text extends the
    last one's.

    >>> visible_text("ab<e", ["<end>"]), visible_text("abc", ["<end>"]), visible_text("a\\ufffd", [])
    ('ab', 'abc', 'a')
    """
    cut = len(text.rstrip("\ufffd"))
    for stop in stops:
        for k in range(min(len(stop) - 1, cut), 0, -1):
            if text[:cut].endswith(stop[:k]):
                cut -= k
                break
    return text[:cut]


async def last(updates: AsyncIterator[Answer]) -> Answer:
    """The final answer of a sample's updates."""
    final = None
    async for answer in updates:
        final = answer
    assert final is not None, "a sample ended without an answer"
    return final


async def respond(request: web.Request, call: GenerateCall[Any], updates: list[AsyncIterator[Answer]]
                  ) -> web.StreamResponse:
    """Answer ``call`` from each job's updates: the final answers as JSON, or every update as it comes."""
    if not call.stream:
        answers = [answer_json(a) for a in await asyncio.gather(*(last(u) for u in updates))]
        body = answers[0] if call.single and len(answers) == 1 else b"[" + b",".join(answers) + b"]"
        return web.Response(body=body, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
    indexed = not (call.single and len(updates) == 1)

    async def pump(job: SampleJob[Any], stream: AsyncIterator[Answer]) -> None:
        try:
            async for answer in stream:
                queue.put_nowait(answer_json(answer, job.index if indexed else None))
        except Exception as exc:  # the sample failed: the stream says so and ends
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(job, stream)) for job, stream in zip(call.jobs, updates, strict=True)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):  # SGLang's form: an error event, then the end
                error = {"error": {"message": f"{type(item).__name__}: {item}", "code": 500}}
                await response.write(stream_frame(json.dumps(error).encode()))
                break
            else:
                await response.write(stream_frame(item))
        await response.write(STREAM_DONE)
    finally:  # the client went away or a sample failed: the others stop (their servers abort them)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
    await response.write_eof()
    return response


__all__ = ["GenerateCall", "GenerateError", "SampleJob", "answer_json", "images_per_prompt", "last", "per_item",
           "prompt_batch", "read_generate", "respond", "sample_answer", "visible_text"]
