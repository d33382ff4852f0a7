"""The OpenAI-compatible front of one engine: requests -> engine ``/generate`` payloads -> OpenAI answers.

No Ray and no HTTP here: :class:`OpenAIFront` gets the tokenizer and an async ``generate(payload)`` that
posts SGLang's ``/generate`` (input_ids, one ``sampling_params`` per row, ``return_logprob``) through
:class:`raygym.rollout.engine.EngineActor`. It applies the chat template, checks the context length,
expands ``n`` into rows (choice ``i`` of prompt ``p`` is row ``p * n + i``, OpenAI's order), gives each
row its own ``sampling_seed`` when the request has a ``seed``, and builds the answers.

Streaming: the engines raygym drives answer ``/generate`` with whole generations, so a ``stream=true``
request is answered in OpenAI's server-sent-event format once the generation is done: per choice the
text as one chunk, then the finish chunk, the usage chunk when ``stream_options.include_usage``, and
``data: [DONE]``. Errors are found before the stream starts, so they keep their HTTP status.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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


def finish_reason(meta: dict[str, Any]) -> str:
    """OpenAI's finish reason from SGLang's ``meta_info.finish_reason`` (``{"type": ...}`` or a string)."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        raise OpenAIError(503, "the engine aborted the request (it is pausing or updating weights); retry",
                          type="server_error", code="engine_aborted")
    return "length" if kind == "length" else "stop"


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
        generate: ``async generate(payload) -> list[dict]`` (SGLang's answer to a batched ``/generate``).
        model_name: the id clients send as ``model`` (``/v1/models`` lists it).
        context_len: prompt + generated tokens the model takes (None = not checked).
        default_max_tokens: chat completions without ``max_tokens`` generate at most this many (and never
            past the context).
    """

    def __init__(self, tokenizer: Any, generate: Callable[[dict[str, Any]], Awaitable[Any]], model_name: str,
                 *, context_len: int | None = None, default_max_tokens: int = 256) -> None:
        self.tokenizer = tokenizer
        self._generate = generate
        self.model_name = model_name
        self.context_len = context_len
        self.default_max_tokens = default_max_tokens
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
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, f"the model `{self.model_name}` has no chat template; use /v1/completions",
                              param="messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in request.messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

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

    async def _run(self, request: CompletionRequest | ChatCompletionRequest, prompts: Sequence[list[int]],
                   limit: int | None, default: int | None, prefix: str) -> Generation:
        self.check_model(request.model)
        n = request.choices
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for p, ids in enumerate(prompts):
            max_new = self._max_tokens(limit, len(ids), default)
            for c in range(n):
                seed = row_seed(request.seed, p, c) if request.seed is not None else None
                input_ids.append(list(ids))
                params.append(self.sampling_params(request, max_new, seed))
        answer = await self._generate({"input_ids": input_ids, "sampling_params": params, "return_logprob": True})
        answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != len(input_ids):
            raise OpenAIError(500, f"the engine answered {len(input_ids)} rows with {len(answers)} outputs",
                              type="server_error")
        rows = [self._row(a) for a in answers]
        return Generation(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), n, [len(ids) for ids in prompts], rows)

    def _row(self, answer: dict[str, Any]) -> RowOutput:
        meta = answer.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        if entries:  # [[logprob, token_id, text-or-null], ...]
            ids, logprobs = [int(e[1]) for e in entries], [float(e[0]) for e in entries]
        else:
            ids, logprobs = [int(t) for t in answer.get("output_ids") or []], []
        text = answer.get("text")
        if not isinstance(text, str):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return RowOutput(text, ids, logprobs, finish_reason(meta))

    async def complete(self, request: CompletionRequest) -> Generation:
        """Run a completions request on the engine."""
        prompts = [self.encode(p) for p in request.prompts()]
        generation = await self._run(request, prompts, request.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "cmpl")
        if request.echo:
            generation.prompts_text = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in request.prompts()]
        return generation

    async def chat(self, request: ChatCompletionRequest) -> Generation:
        """Run a chat completions request on the engine (the chat template applied)."""
        prompt = self.encode(self.chat_prompt(request))
        return await self._run(request, [prompt], request.token_limit(), None, "chatcmpl")

    # ── answers ─────────────────────────────────────────────────────────────────────────────────
    def _token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text as it appears in the answer (special tokens are not part of the text)."""
        return [self.tokenizer.decode([t], skip_special_tokens=True) for t in ids]

    def _completion_logprobs(self, row: RowOutput, offset: int) -> CompletionLogprobs:
        tokens = self._token_texts(row.token_ids)
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=row.logprobs, text_offset=offsets)

    def completion_body(self, request: CompletionRequest, g: Generation) -> Completion:
        choices = []
        for i, row in enumerate(g.rows):
            echo = g.prompts_text[i // g.choices_per_prompt] if g.prompts_text else ""
            logprobs = self._completion_logprobs(row, len(echo)) if request.logprobs is not None else None
            choices.append(CompletionChoice(index=i, text=echo + row.text, logprobs=logprobs,
                                            finish_reason=row.finish_reason))  # type: ignore[arg-type]
        return Completion(id=g.id, created=g.created, model=self.model_name, choices=choices, usage=g.usage())

    def _chat_logprobs(self, row: RowOutput) -> ChoiceLogprobs:
        tokens = self._token_texts(row.token_ids)
        return ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                       for t, lp in zip(tokens, row.logprobs, strict=False)])

    def chat_body(self, request: ChatCompletionRequest, g: Generation) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=AssistantMessage(content=row.text),
                              logprobs=self._chat_logprobs(row) if request.logprobs else None,
                              finish_reason=row.finish_reason)  # type: ignore[arg-type]
                   for i, row in enumerate(g.rows)]
        return ChatCompletion(id=g.id, created=g.created, model=self.model_name, choices=choices, usage=g.usage())

    # ── server-sent events ──────────────────────────────────────────────────────────────────────
    @staticmethod
    def sse(payload: Any) -> str:
        body = payload if isinstance(payload, str) else json.dumps(payload.model_dump(exclude_none=False))
        return f"data: {body}\n\n"

    async def completion_events(self, request: CompletionRequest, g: Generation) -> AsyncIterator[str]:
        """The SSE frames of a streamed completion."""
        body = self.completion_body(request, g)
        for choice in body.choices:
            text = choice.model_copy(update={"finish_reason": None})
            yield self.sse(Completion(id=g.id, created=g.created, model=self.model_name, choices=[text]))
            end = CompletionChoice(index=choice.index, text="", finish_reason=choice.finish_reason)
            yield self.sse(Completion(id=g.id, created=g.created, model=self.model_name, choices=[end]))
        if request.include_usage():
            yield self.sse(Completion(id=g.id, created=g.created, model=self.model_name, choices=[], usage=g.usage()))
        yield self.sse("[DONE]")

    async def chat_events(self, request: ChatCompletionRequest, g: Generation) -> AsyncIterator[str]:
        """The SSE frames of a streamed chat completion."""
        def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            return self.sse(ChatCompletionChunk(id=g.id, created=g.created, model=self.model_name, choices=choices,
                                                usage=usage))

        for i, row in enumerate(g.rows):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
            logprobs = self._chat_logprobs(row) if request.logprobs else None
            yield chunk([ChunkChoice(index=i, delta=Delta(content=row.text), logprobs=logprobs)])
            yield chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=row.finish_reason)])  # type: ignore[arg-type]
        if request.include_usage():
            yield chunk([], g.usage())
        yield self.sse("[DONE]")


__all__ = ["Generation", "OpenAIError", "OpenAIFront", "finish_reason", "row_seed"]
