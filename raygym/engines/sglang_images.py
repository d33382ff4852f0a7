"""Image requests as stock SGLang takes them: one ``<|image_pad|>`` per image, which SGLang widens itself.

raygym's ``/generate`` contract (:class:`raygym.engine_api.protocol.GenerateRequest`) sends ``input_ids`` already
widened: each image's pad repeated once per merged patch (:func:`raygym.vision.tokens.expand_image_pads`), with
``image_data`` the prompt's images. SGLang (0.5.18, ``srt/multimodal/processors/base_processor.py``) wants the
prompt as written: with ``SGLANG_MM_AVOID_RETOKENIZE`` (its default) it keeps the prompt's tokens and widens the
k-th pad to the k-th image's tokens (``_expand_input_ids``, which refuses a prompt whose pads are not one per
image); otherwise it decodes the prompt and runs the HF processor over the text, which widens every pad again. Sent
widened, a prompt fails that check, falls back to the processor and the request never answers (the processor
raises ``StopIteration`` into a future). SGLang then computes the M-RoPE positions of the prompt it widened
(``MRotaryEmbedding.get_rope_index``: raygym's :func:`raygym.vision.tokens.mrope_positions`), and its answer is
for the widened prompt again: ``prompt_tokens`` counts every image token, ``logprob_start_len`` and the response's
tokens and log-probs are where raygym expects them.

So the conversion belongs where raygym talks to stock SGLang: :func:`sglang_request` collapses each image's run of
pads back to one, and :class:`SGLangImageClient` (the rollout manager's engine clients) and
:meth:`raygym.engines.actor.EngineActor.generate` send requests through it; an answer whose ``prompt_tokens`` is
not the widened prompt's length (SGLang widened an image differently) is refused as malformed.

A batch with images is sent as one request per prompt, concurrently: SGLang (0.5.18) tokenizes a batch with images
prompt by prompt and starts waiting for the answers only after the last one (``TokenizerManager._handle_batch_request``);
a prompt that finishes before that has its state dropped already, and the whole batch fails with a ``KeyError`` in
``_wait_one_response`` (HTTP 500). One prompt per request waits from the moment it is sent.

SGLang finds a prompt's images as ``<|vision_start|><|image_pad|><|vision_end|>`` in its text; a pad anywhere
else (a response that sampled it, continued after an abort) would be another image to it, and a prompt whose
placeholders are not one per image goes down a path that never answers either. Such a request is refused with a
400 naming the reason, before it reaches SGLang.

>>> tokens = ImageTokens(start=50, pad=9, end=52)
>>> collapse_image_pads([7, 50, 9, 9, 9, 9, 52, 5, 50, 9, 9, 52], tokens, images=2)
[7, 50, 9, 52, 5, 50, 9, 52]
>>> request = GenerateRequest(input_ids=[[50, 9, 9, 9, 9, 52, 5], [5, 6]], image_data=[["data:image/png;base64,AA=="], []])
>>> sglang_request(request, tokens).input_ids
[[50, 9, 52, 5], [5, 6]]
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

from raygym.engine_api.client import EngineAnswerError, EngineClient, EngineHTTPError
from raygym.engine_api.protocol import Endpoint, GenerateRequest, GenerateResponse
from raygym.engines.serving.generate_route import images_per_prompt


class ImageTokens(NamedTuple):
    """A Qwen2-VL-family model's image placeholder tokens: ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``."""

    start: int
    pad: int
    end: int


class ImageRequestError(EngineHTTPError):
    """A request with images that stock SGLang cannot be given as it is (a 400: sending it elsewhere won't help)."""

    def __init__(self, base_url: str, message: str) -> None:
        super().__init__(base_url, Endpoint.GENERATE.value, 400, message)


def pad_runs(ids: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``image_token`` in ``ids``.

    >>> pad_runs([9, 9, 5, 9], 9)
    [(0, 2), (3, 1)]
    """
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != image_token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def collapse_image_pads(ids: Sequence[int], tokens: ImageTokens, *, images: int) -> list[int]:
    """``ids`` (widened: each image's pads one run between ``<|vision_start|>`` and ``<|vision_end|>``) with each
    of its ``images`` runs of pads made one pad. ValueError when the pads are not ``images`` such runs."""
    runs = pad_runs(ids, tokens.pad)
    if len(runs) != images:
        extra = (" (a pad token after the images, e.g. one a response sampled, would be another image to SGLang)"
                 if len(runs) > images else "")
        raise ValueError(f"the prompt holds {len(runs)} run(s) of image pad tokens for its {images} image(s){extra}; "
                         "stock SGLang takes one image per pad")
    for k, (start, length) in enumerate(runs):
        end = start + length
        if start == 0 or ids[start - 1] != tokens.start or end >= len(ids) or ids[end] != tokens.end:
            raise ValueError(f"image {k}'s pad tokens (at {start}) are not between <|vision_start|> and "
                             "<|vision_end|>: stock SGLang finds images by that placeholder")
    out: list[int] = []
    last = 0
    for start, length in runs:
        out.extend(ids[last:start + 1])
        last = start + length
    out.extend(ids[last:])
    return out


def _rows(request: GenerateRequest) -> tuple[list[list[int]], bool]:
    ids = request.input_ids
    assert ids is not None
    if ids and isinstance(ids[0], list):
        return [list(row) for row in ids], False  # type: ignore[arg-type]
    return [list(ids)], True  # type: ignore[arg-type]


def sglang_request(request: GenerateRequest, tokens: ImageTokens) -> GenerateRequest:
    """``request`` with one image pad per image in every prompt that has images (module docstring); unchanged
    without ``image_data`` or ``input_ids``. ValueError when a prompt's pads are not one run per image, or
    ``image_data`` does not fit the prompts."""
    if request.image_data is None or request.input_ids is None:
        return request
    rows, single = _rows(request)
    counts = [len(images) for images in images_per_prompt(request.image_data, len(rows), single)]
    out = []
    for k, (row, images) in enumerate(zip(rows, counts, strict=True)):
        try:
            out.append(collapse_image_pads(row, tokens, images=images) if images else row)
        except ValueError as exc:
            raise ValueError(f"prompt {k}: {exc}") from None
    return request.model_copy(update={"input_ids": out[0] if single else out})


# GenerateRequest fields that a batch may give per prompt (a list with one entry per prompt)
PER_PROMPT_FIELDS = ("text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                     "rid", "lora_path", "return_routed_experts")


def samples_per_prompt(request: GenerateRequest) -> int:
    """``n`` of ``request``'s sampling params (SGLang takes one ``n`` for a whole batch)."""
    params = request.sampling_params
    n = params.get("n", 1) if isinstance(params, dict) else (params[0].get("n", 1) if params else 1)
    return n if isinstance(n, int) else 1


def split_prompts(request: GenerateRequest) -> list[GenerateRequest] | None:
    """A batch of ``input_ids`` with images as one request per prompt (module docstring); None for one prompt, a
    batch of one, or a batch without images.

    >>> parts = split_prompts(GenerateRequest(input_ids=[[1], [2]], image_data=[["a"], []], sampling_params=[{"n": 1}] * 2,
    ...                                      return_logprob=True))
    >>> [(r.input_ids, r.image_data, r.sampling_params, r.return_logprob) for r in parts]
    [([1], ['a'], {'n': 1}, True), ([2], None, {'n': 1}, True)]
    """
    if request.image_data is None or request.input_ids is None:
        return None
    rows, single = _rows(request)
    if single or len(rows) < 2:
        return None
    images = images_per_prompt(request.image_data, len(rows), single)
    if not any(images):
        return None
    fields = request.model_dump(exclude_none=True)
    parts = []
    for k, row_images in enumerate(images):
        part = dict(fields)
        for name in PER_PROMPT_FIELDS:
            value = fields.get(name)
            if isinstance(value, list) and len(value) == len(rows):
                part[name] = value[k]
        part["input_ids"] = rows[k]
        part.pop("image_data", None)
        if row_images:
            part["image_data"] = row_images
        parts.append(GenerateRequest.model_validate(part))
    return parts


def widened_lengths(request: GenerateRequest) -> list[int]:
    """The prompt length each answer to ``request`` must report (``prompt_tokens``), in SGLang's answer order:
    prompt by prompt, ``n`` samples each."""
    rows, _ = _rows(request)
    n = samples_per_prompt(request)
    return [len(row) for row in rows for _ in range(n)]


def check_prompt_tokens(request: GenerateRequest, answer: GenerateResponse | list[GenerateResponse], url: str) -> None:
    """EngineAnswerError when an answer to a request with images reports another prompt length than raygym's
    widened prompt (SGLang widened an image to another number of tokens than raygym's processor did: its
    positions, and the trainer's, would not be the same)."""
    answers = answer if isinstance(answer, list) else [answer]
    want = widened_lengths(request)
    if len(answers) != len(want):
        return  # the pool reports a wrong number of answers itself
    for k, (got, length) in enumerate(zip(answers, want, strict=True)):
        reported = got.meta_info.prompt_tokens
        if reported and reported != length:
            raise EngineAnswerError(f"{url}/generate: answer {k} reports {reported} prompt tokens for a prompt of "
                                    f"{length} (images widened to other token counts than raygym's processor's)")


class SGLangImageClient(EngineClient):
    """An :class:`EngineClient` for stock SGLang serving a vision-language model: ``/generate`` requests with images
    go with one pad per image (:func:`sglang_request`), a batch of them one request per prompt (:func:`split_prompts`);
    a request that cannot go is refused with :class:`ImageRequestError` (a 400) before anything is sent."""

    def __init__(self, base_url: str, *, image_tokens: ImageTokens, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.image_tokens = image_tokens

    def _convert(self, request: GenerateRequest) -> GenerateRequest:
        try:
            return sglang_request(request, self.image_tokens)
        except ValueError as exc:
            raise ImageRequestError(self.base_url, str(exc)) from None

    async def generate(self, request: GenerateRequest, *, timeout: float | None = None
                       ) -> GenerateResponse | list[GenerateResponse]:
        parts = split_prompts(request)
        if parts is not None:  # one request per prompt, answered in the batch's order (prompt by prompt, n each)
            converted = [self._convert(part) for part in parts]  # refuse before sending any
            answers = await asyncio.gather(*(self._generate_one(part, sent, timeout)
                                             for part, sent in zip(parts, converted, strict=True)))
            return [a for answer in answers for a in (answer if isinstance(answer, list) else [answer])]
        return await self._generate_one(request, self._convert(request), timeout)

    async def _generate_one(self, request: GenerateRequest, sent: GenerateRequest, timeout: float | None
                            ) -> GenerateResponse | list[GenerateResponse]:
        answer = await super().generate(sent, timeout=timeout)
        if request.image_data is not None and request.input_ids is not None:
            check_prompt_tokens(request, answer, self.base_url)
        return answer

    async def generate_stream(self, request: GenerateRequest, *, timeout: float | None = None
                              ) -> AsyncIterator[GenerateResponse]:
        parts = split_prompts(request)
        if parts is None:
            async for update in super().generate_stream(self._convert(request), timeout=timeout):
                yield update
            return
        converted = [self._convert(part) for part in parts]
        n = samples_per_prompt(request)
        async for update in self._merged_streams(converted, n, timeout):
            yield update

    async def _merged_streams(self, parts: list[GenerateRequest], n: int, timeout: float | None
                              ) -> AsyncIterator[GenerateResponse]:
        """The updates of one stream per prompt as they come, each ``index`` its row in the whole batch."""
        queue: asyncio.Queue[tuple[int, GenerateResponse | Exception | None]] = asyncio.Queue()

        async def pump(k: int, part: GenerateRequest) -> None:
            try:
                async for update in EngineClient.generate_stream(self, part, timeout=timeout):
                    await queue.put((k, update))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((k, exc))
                return
            await queue.put((k, None))

        tasks = [asyncio.ensure_future(pump(k, part)) for k, part in enumerate(parts)]
        try:
            running = len(tasks)
            while running:
                k, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                yield item.model_copy(update={"index": k * n + (item.index or 0)})
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@functools.lru_cache(maxsize=16)
def checkpoint_image_tokens(model_path: str) -> ImageTokens | None:
    """The image placeholder tokens of the vision-language checkpoint at ``model_path`` (a local directory, its
    ``config.json``); None for a text model or a checkpoint not on this machine."""
    from raygym.vision.qwen_vl import checkpoint_config

    try:
        config = checkpoint_config(model_path)
    except (OSError, ValueError):
        return None
    if not config or "vision_config" not in config:
        return None
    keys = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    if any(config.get(key) is None for key in keys):
        return None
    return ImageTokens(*(int(config[key]) for key in keys))


def tokenizer_image_tokens(tokenizer: Any) -> ImageTokens | None:
    """The image placeholder tokens in ``tokenizer``; None when it lacks them (a text model's)."""
    from raygym.vision.qwen_vl import IMAGE_PAD, VISION_END, VISION_START

    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    names = (VISION_START, IMAGE_PAD, VISION_END)
    if any(vocab.get(name) is None for name in names):
        return None
    return ImageTokens(*(int(vocab[name]) for name in names))


def engine_client(kind: str, url: str, *, image_tokens: ImageTokens | None,
                  timeout: float | None = None) -> EngineClient:
    """The client raygym talks to engine ``url`` of ``kind`` through: :class:`SGLangImageClient` for stock SGLang
    on a vision-language model (``image_tokens`` its placeholder's), a plain :class:`EngineClient` otherwise."""
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if kind == "sglang" and image_tokens is not None:
        return SGLangImageClient(url, image_tokens=image_tokens, **options)
    return EngineClient(url, **options)


def client_factory(kind: str, image_tokens: ImageTokens | None,
                   timeout: float | None) -> Callable[[str], EngineClient] | None:
    """The rollout's engine clients (``EnginePool``'s ``client_factory``) for engines of ``kind`` on a model with
    ``image_tokens``; None where plain clients do (not SGLang, or a text model)."""
    if kind != "sglang" or image_tokens is None:
        return None
    return functools.partial(engine_client, kind, image_tokens=image_tokens, timeout=timeout)
