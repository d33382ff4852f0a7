"""The OpenAI-compatible front of one engine: requests -> engine ``/generate`` requests -> OpenAI answers.

No Ray and no HTTP here: :class:`OpenAIFront` gets the tokenizer and an :class:`Engine` that posts SGLang's
``/generate`` (:class:`~raygym.engine_api.protocol.GenerateRequest`: input_ids, one ``sampling_params`` per
row, ``return_logprob``) through :class:`raygym.engines.actor.EngineActor`. It applies the chat template,
checks the context length, expands ``n`` into rows (choice ``i`` of prompt ``p`` is row ``p * n + i``,
OpenAI's order), gives each row its own ``sampling_seed`` when the request has a ``seed``, and builds the
answers.

Images (a vision-language checkpoint): chat messages may carry OpenAI ``image_url`` parts as data URLs;
:mod:`raygym.serve.images` decodes them, widens their pad tokens and the request carries ``image_data``.

Streaming (``stream=true``): the engine streams the generation (``/generate`` with ``stream: true``) and
:class:`OpenAIStream` turns each update into OpenAI chunks as it arrives, so the first tokens
reach the client while the rest are generated. The first update is awaited before the answer starts, so
request errors (the engine's too) keep their HTTP status.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from raygym.serve.images import ChatImages

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def row_seed(seed: int, prompt_index: int, choice_index: int) -> int:
    """The ``sampling_seed`` of one row of a request with ``seed`` (distinct per prompt and choice).

    >>> row_seed(7, 0, 0) == row_seed(7, 0, 0) != row_seed(7, 0, 1)
    True
    """
    digest = hashlib.blake2b(repr(("serve", int(seed), prompt_index, choice_index)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


ENGINE_ABORTED = "the engine aborted the request (it is pausing or updating weights); retry"


def finish_reason(answer: GenerateResponse) -> str:
    """OpenAI's finish reason of a finished engine answer (an aborted one is a 503 to retry)."""
    if answer.finish_type == "abort":
        raise OpenAIError(503, ENGINE_ABORTED, type="server_error", code="engine_aborted")
    return "length" if answer.finish_type == "length" else "stop"


class Engine(Protocol):
    """What the front needs of an engine: ``/generate``, whole and streamed."""

    def generate(self, request: GenerateRequest) -> Awaitable[GenerateResponse | list[GenerateResponse]]: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]: ...


@dataclass
class RowOutput:
    """One generated row: one choice of one prompt."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass
class Generation:
    """A finished request: its rows (prompt-major), prompt lengths, and what the answer needs."""

    id: str
    created: int
    choices_per_prompt: int
    prompt_lengths: list[int]
    rows: list[RowOutput]
    prompts_text: list[str] = field(default_factory=list)  # for echo

    def usage(self) -> Usage:
        completion = sum(len(r.token_ids) for r in self.rows)
        prompt = sum(self.prompt_lengths)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class OpenAIFront:
    """OpenAI completions / chat completions / models over one engine's ``/generate``.

    Args:
        tokenizer: the model's HF tokenizer (encodes prompts, applies the chat template, names tokens).
        engine: the engine's ``/generate``, whole (``generate``) and streamed (``generate_stream``).
        model_name: the id clients send as ``model`` (``/v1/models`` lists it).
        context_len: prompt + generated tokens the model takes (None = not checked).
        default_max_tokens: chat completions without ``max_tokens`` generate at most this many (and never
            past the context).
        images: how chat images become prompt tokens and ``image_data`` (a vision-language model's,
            :class:`raygym.serve.images.ChatImages`); None: a text-only model, which refuses images.
    """

    def __init__(self, tokenizer: Any, engine: Engine, model_name: str,
                 *, context_len: int | None = None, default_max_tokens: int = 256,
                 images: ChatImages | None = None) -> None:
        self.tokenizer = tokenizer
        self.engine = engine
        self.model_name = model_name
        self.context_len = context_len
        self.default_max_tokens = default_max_tokens
        self.images = images
        self.created = int(time.time())

    # ── models ──────────────────────────────────────────────────────────────────────────────────
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    def model(self, name: str) -> ModelCard:
        self.check_model(name)
        return ModelCard(id=self.model_name, created=self.created)

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                              param="model", code="model_not_found")

    # ── prompts ─────────────────────────────────────────────────────────────────────────────────
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        vocab = len(self.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"prompt holds token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}",
                              param="prompt")
        return list(prompt)

    def chat_prompt(self, request: ChatCompletionRequest) -> str:
        self._check_chat_template()
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in request.messages]
        return self.render_chat(messages)

    def _check_chat_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, f"the model `{self.model_name}` has no chat template; use /v1/completions",
                              param="messages")

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def chat_input(self, request: ChatCompletionRequest) -> tuple[list[int], list[str]]:
        """The prompt tokens of a chat request and its images (PNG data URLs; none for text). With images, the
        pads are widened for the model's image processor (:mod:`raygym.serve.images`, off the event loop)."""
        if not request.has_images():
            return self.encode(self.chat_prompt(request)), []
        self.check_model(request.model)
        if self.images is None:
            raise OpenAIError(400, f"the model `{self.model_name}` is a text-only model and takes no images; send "
                              "messages without image_url parts, or serve a vision-language checkpoint",
                              param="messages", code="images_not_supported")
        self._check_chat_template()
        from raygym.serve.images import ImageRefused

        try:
            built = await asyncio.to_thread(self.images.build, request.messages, self.render_chat)
        except ImageRefused as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        return built.tokens, built.images

    def _max_tokens(self, asked: int | None, prompt_len: int, default: int | None) -> int:
        if self.context_len is not None and prompt_len >= self.context_len:
            raise OpenAIError(400, f"This model's maximum context length is {self.context_len} tokens; your prompt "
                              f"has {prompt_len}", param="messages", code="context_length_exceeded")
        if asked is None:
            room = self.context_len - prompt_len if self.context_len is not None else None
            return min(x for x in (default or self.default_max_tokens, room) if x is not None)
        if self.context_len is not None and prompt_len + asked > self.context_len:
            raise OpenAIError(400, f"This model's maximum context length is {self.context_len} tokens. However, you "
                              f"requested {prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the "
                              "completion). Please reduce the prompt or max_tokens.",
                              param="max_tokens", code="context_length_exceeded")
        return asked

    # ── generation ──────────────────────────────────────────────────────────────────────────────
    def sampling_params(self, request: CompletionRequest | ChatCompletionRequest, max_new_tokens: int,
                        seed: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
        }
        if request.stop_list():
            params["stop"] = request.stop_list()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(request, name)
            if value:
                params[name] = value
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    def engine_request(self, request: CompletionRequest | ChatCompletionRequest, prompts: Sequence[list[int]],
                       limit: int | None, default: int | None,
                       images: Sequence[list[str]] | None = None) -> GenerateRequest:
        """The batched ``/generate`` request of ``request``'s rows (prompt-major, ``n`` rows per prompt);
        ``images``: each prompt's images (``image_data``, one list per row), if any has some."""
        self.check_model(request.model)
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        image_data: list[list[str]] = []
        for p, ids in enumerate(prompts):
            max_new = self._max_tokens(limit, len(ids), default)
            for c in range(request.choices):
                seed = row_seed(request.seed, p, c) if request.seed is not None else None
                input_ids.append(list(ids))
                params.append(self.sampling_params(request, max_new, seed))
                image_data.append(list(images[p]) if images else [])
        extra: dict[str, Any] = {"image_data": image_data} if any(image_data) else {}  # unset, not null, for text
        return GenerateRequest(input_ids=input_ids, sampling_params=params, return_logprob=True, **extra)

    async def _run(self, request: CompletionRequest | ChatCompletionRequest, prompts: Sequence[list[int]],
                   limit: int | None, default: int | None, prefix: str,
                   images: Sequence[list[str]] | None = None) -> Generation:
        engine_request = self.engine_request(request, prompts, limit, default, images)
        answer = await self.engine.generate(engine_request)
        answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != len(engine_request.input_ids or []):
            raise OpenAIError(500, f"the engine answered {len(engine_request.input_ids or [])} rows with "
                              f"{len(answers)} outputs", type="server_error")
        rows = [self._row(a) for a in answers]
        return Generation(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), request.choices,
                          [len(ids) for ids in prompts], rows)

    def _row(self, answer: GenerateResponse) -> RowOutput:
        ids, logprobs = answer.tokens_and_logprobs()
        return RowOutput(answer.text, ids, logprobs, finish_reason(answer))

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        return [self.encode(p) for p in request.prompts()]

    def echo_texts(self, request: CompletionRequest) -> list[str]:
        """Each prompt's text as ``echo`` repeats it (empty without ``echo``)."""
        if not request.echo:
            return []
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in request.prompts()]

    async def complete(self, request: CompletionRequest) -> Generation:
        """Run a completions request on the engine."""
        generation = await self._run(request, self.completion_prompts(request), request.max_tokens,
                                     COMPLETION_DEFAULT_MAX_TOKENS, "cmpl")
        generation.prompts_text = self.echo_texts(request)
        return generation

    async def chat(self, request: ChatCompletionRequest) -> Generation:
        """Run a chat completions request on the engine (the chat template applied)."""
        prompt, images = await self.chat_input(request)
        return await self._run(request, [prompt], request.token_limit(), None, "chatcmpl", [images])

    async def stream_completion(self, request: CompletionRequest) -> AsyncIterator[str]:
        """The SSE frames of a streamed completion, once the engine sent its first update (errors before that
        raise, keeping their HTTP status)."""
        prompts = self.completion_prompts(request)
        engine_request = self.engine_request(request, prompts, request.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        stream = OpenAIStream(self, request, "cmpl", [len(ids) for ids in prompts], chat=False,
                              echo=self.echo_texts(request))
        return await stream.start(self.engine.generate_stream(engine_request))

    async def stream_chat(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """The SSE frames of a streamed chat completion (see :meth:`stream_completion`)."""
        prompt, images = await self.chat_input(request)
        engine_request = self.engine_request(request, [prompt], request.token_limit(), None, [images])
        stream = OpenAIStream(self, request, "chatcmpl", [len(prompt)], chat=True)
        return await stream.start(self.engine.generate_stream(engine_request))

    # ── answers ─────────────────────────────────────────────────────────────────────────────────
    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text as it appears in the answer (special tokens are not part of the text)."""
        return [self.tokenizer.decode([t], skip_special_tokens=True) for t in ids]

    def completion_logprobs(self, ids: list[int], logprobs: list[float], offset: int) -> CompletionLogprobs:
        """OpenAI's completion log-probs of tokens ``ids``, their text starting at ``offset`` of the choice."""
        tokens = self.token_texts(ids)
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, text_offset=offsets)

    def completion_body(self, request: CompletionRequest, g: Generation) -> Completion:
        choices = []
        for i, row in enumerate(g.rows):
            echo = g.prompts_text[i // g.choices_per_prompt] if g.prompts_text else ""
            logprobs = (self.completion_logprobs(row.token_ids, row.logprobs, len(echo))
                        if request.logprobs is not None else None)
            choices.append(CompletionChoice(index=i, text=echo + row.text, logprobs=logprobs,
                                            finish_reason=row.finish_reason))  # type: ignore[arg-type]
        return Completion(id=g.id, created=g.created, model=self.model_name, choices=choices, usage=g.usage())

    def chat_logprobs(self, ids: list[int], logprobs: list[float]) -> ChoiceLogprobs:
        """OpenAI's chat log-probs of tokens ``ids``."""
        tokens = self.token_texts(ids)
        return ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                       for t, lp in zip(tokens, logprobs, strict=False)])

    def chat_body(self, request: ChatCompletionRequest, g: Generation) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=row.text),
                              logprobs=self.chat_logprobs(row.token_ids, row.logprobs) if request.logprobs else None,
                              finish_reason=row.finish_reason)  # type: ignore[arg-type]
                   for i, row in enumerate(g.rows)]
        return ChatCompletion(id=g.id, created=g.created, model=self.model_name, choices=choices, usage=g.usage())


def sse(payload: Any) -> str:
    """One server-sent event: a model as JSON, or a literal (``[DONE]``)."""
    body = payload if isinstance(payload, str) else json.dumps(payload.model_dump(exclude_none=False))
    return f"data: {body}\n\n"


def engine_error(exc: Exception) -> OpenAIError:
    """An engine failure as OpenAI's error: the engine's 4xx refusals are the client's (400), the rest 5xx."""
    from raygym.engine_api.client import EngineConnectionError, EngineHTTPError

    if isinstance(exc, EngineHTTPError) and 400 <= exc.status < 500:
        return OpenAIError(400, f"the engine refused the request: {exc.message()}")
    if isinstance(exc, EngineConnectionError):
        return OpenAIError(503, "the engine is unavailable; retry shortly", type="server_error",
                           code="engine_unavailable")
    return OpenAIError(500, "the engine failed to generate", type="server_error")


@dataclass
class _RowStream:
    """What one row (choice) of a stream has sent so far."""

    text: str = ""
    tokens: int = 0
    started: bool = False
    completion_tokens: int = 0
    finished: bool = False


class OpenAIStream:
    """OpenAI's server-sent events of one streamed request, from the engine's stream of updates (each a whole
    answer so far for row ``index``): per row the role chunk (chat) or the echoed prompt (completions), then
    the new text of each update as it arrives, the finish chunk; the usage chunk when
    ``stream_options.include_usage``; ``data: [DONE]``. A failure after the answer started is an ``error`` event
    (OpenAI's form) before the end."""

    def __init__(self, front: OpenAIFront, request: CompletionRequest | ChatCompletionRequest, prefix: str,
                 prompt_lengths: list[int], *, chat: bool, echo: Sequence[str] = ()) -> None:
        self.front, self.request, self.chat = front, request, chat
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        self.prompt_lengths, self.echo = prompt_lengths, list(echo)
        self.rows = [_RowStream() for _ in range(len(prompt_lengths) * request.choices)]

    async def start(self, updates: AsyncIterator[GenerateResponse]) -> AsyncIterator[str]:
        """Wait for the engine's first update (its errors raise here), then the frames."""
        it = updates.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise OpenAIError(500, "the engine ended the stream without an answer", type="server_error") from None
        except OpenAIError:
            raise
        except Exception as exc:
            raise engine_error(exc) from exc
        if first.finish_type == "abort":
            raise OpenAIError(503, ENGINE_ABORTED, type="server_error", code="engine_aborted")
        return self._frames(first, it)

    async def _frames(self, first: GenerateResponse, it: AsyncIterator[GenerateResponse]) -> AsyncIterator[str]:
        try:
            update: GenerateResponse | None = first
            while update is not None:
                for frame in self._on_update(update):
                    yield frame
                update = await anext(it, None)
            if not all(row.finished for row in self.rows):
                raise OpenAIError(500, "the engine ended the stream before every choice finished", type="server_error")
        except Exception as exc:  # the answer has started: the status is sent, the error goes in the stream
            error = exc if isinstance(exc, OpenAIError) else engine_error(exc)
            yield f"data: {json.dumps(error.body())}\n\n"
        else:
            if self.request.include_usage():
                yield self._frame([], self._usage())
        finally:
            closing = getattr(it, "aclose", None)
            if closing is not None:  # a client that left: end the engine's stream, which aborts its rows
                await closing()
        yield sse("[DONE]")

    def _on_update(self, update: GenerateResponse) -> list[str]:
        index = update.index or 0
        if not 0 <= index < len(self.rows):
            raise OpenAIError(500, f"the engine streamed row {index} of {len(self.rows)}", type="server_error")
        row, frames = self.rows[index], []
        if update.finish_type == "abort":
            raise OpenAIError(503, ENGINE_ABORTED, type="server_error", code="engine_aborted")
        echo = ""
        if not row.started:
            row.started = True
            if self.chat:
                frames.append(self._frame([ChunkChoice(index=index, delta=Delta(role="assistant", content=""))]))
            elif self.echo:
                echo = self.echo[index // self.request.choices]
        finished = update.finish_type != ""
        delta = update.text[len(row.text):] if update.text.startswith(row.text) else ""
        if delta or echo or (finished and update.output_ids[row.tokens:]):
            frames.append(self._text_frame(index, row, update, echo + delta))
            row.text += delta
        if finished:
            row.finished, row.completion_tokens = True, update.meta_info.completion_tokens
            reason = finish_reason(update)
            if self.chat:
                frames.append(self._frame([ChunkChoice(index=index, delta=Delta(), finish_reason=reason)]))  # type: ignore[arg-type]
            else:
                frames.append(self._frame([CompletionChoice(index=index, text="", finish_reason=reason)]))  # type: ignore[arg-type]
        return frames

    def _text_frame(self, index: int, row: _RowStream, update: GenerateResponse, text: str) -> str:
        ids, logprobs = update.tokens_and_logprobs()
        new_ids, new_logprobs = ids[row.tokens:], logprobs[row.tokens:]
        row.tokens = len(ids)
        if self.chat:
            chat_lp = self.front.chat_logprobs(new_ids, new_logprobs) if self.request.logprobs else None
            return self._frame([ChunkChoice(index=index, delta=Delta(content=text), logprobs=chat_lp)])
        echo = len(self.echo[index // self.request.choices]) if self.echo else 0
        lp = (self.front.completion_logprobs(new_ids, new_logprobs, echo + len(row.text))
              if self.request.logprobs is not None else None)
        return self._frame([CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=None)])

    def _usage(self) -> Usage:
        prompt, completion = sum(self.prompt_lengths), sum(row.completion_tokens for row in self.rows)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _frame(self, choices: list[Any], usage: Usage | None = None) -> str:
        model = self.front.model_name
        if self.chat:
            return sse(ChatCompletionChunk(id=self.id, created=self.created, model=model, choices=choices, usage=usage))
        return sse(Completion(id=self.id, created=self.created, model=model, choices=choices, usage=usage))


__all__ = ["Engine", "Generation", "OpenAIError", "OpenAIFront", "OpenAIStream", "engine_error", "finish_reason",
           "row_seed", "sse"]
