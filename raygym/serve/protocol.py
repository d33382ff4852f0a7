"""OpenAI API shapes (pydantic only): the requests ``raygym serve`` accepts and the responses it sends.

Field names and types follow the ``openai`` package's own types (``openai.types.Completion``,
``openai.types.chat.ChatCompletion`` / ``ChatCompletionChunk``, ``openai.types.Model``). Request fields
the server cannot honour (tools, response formats, logit bias, top logprobs) are refused with a 400
naming the parameter instead of being silently ignored; bookkeeping fields (``user``, ``metadata``,
``store``, ...) are accepted and ignored. Chat messages' content may be text or OpenAI content parts: ``text``
and ``image_url`` (images are served for vision-language models, as data URLs only: :mod:`raygym.serve.images`).

>>> CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 4}).prompts()
['hi']
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Accepted and ignored (they change nothing about the generation).
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls",
})
MAX_CHOICES = 128


class UnsupportedParameter(ValueError):
    """A request field the server does not support; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _refuse_unknown(self) -> _GenerationRequest:
        for name in self.model_extra or {}:
            if name not in IGNORED_FIELDS:
                raise UnsupportedParameter(name, f"Unrecognized request argument supplied: {name}")
        if self.logit_bias:
            raise UnsupportedParameter("logit_bias", "logit_bias is not supported by this server")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise UnsupportedParameter("stop", "stop: at most 4 sequences")
        return self

    @property
    def choices(self) -> int:
        return self.n or 1

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text, a list of texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.logprobs:
            raise UnsupportedParameter("logprobs", "logprobs > 0 (top alternatives) is not supported; use 0 for the "
                                       "sampled tokens' log-probabilities")
        if self.best_of is not None and self.best_of != self.choices:
            raise UnsupportedParameter("best_of", "best_of must equal n (or be omitted)")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise UnsupportedParameter("prompt", "prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry each (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    detail: str | None = None  # OpenAI's "auto" | "low" | "high": accepted, the image processor decides


class ImagePart(BaseModel):
    """OpenAI's image content part; only ``data:image/...;base64,...`` URLs are served
    (:mod:`raygym.serve.images`: the server fetches nothing)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["image_url"]
    image_url: ImageURL

    @property
    def url(self) -> str:
        return self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (its text parts joined; image parts are not text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_parts(self) -> list[ImagePart]:
        """The message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part for part in self.content if isinstance(part, ImagePart)]


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise UnsupportedParameter(name, f"{name}: tool calling is not supported by this server")
        if self.response_format not in (None, {"type": "text"}):
            raise UnsupportedParameter("response_format", "response_format: only {'type': 'text'} is supported")
        if self.top_logprobs:
            raise UnsupportedParameter("top_logprobs", "top_logprobs > 0 is not supported; logprobs=true gives "
                                       "the sampled tokens' log-probabilities")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def has_images(self) -> bool:
        return any(m.image_parts() for m in self.messages)


# ── responses ────────────────────────────────────────────────────────────────────────────────────


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """Both the answer and each streamed chunk of ``/v1/completions`` (the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raygym"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


__all__ = [
    "ChatCompletion", "ChatCompletionChunk", "ChatCompletionRequest", "ChatMessage", "Completion",
    "CompletionRequest", "ErrorResponse", "ImagePart", "ImageURL", "ModelCard", "ModelList", "TextPart",
    "UnsupportedParameter", "Usage",
]
