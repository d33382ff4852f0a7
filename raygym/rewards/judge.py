"""An LLM judge as a reward: prompt template, score parsing, batching, a cache.

The judge's engines are a group of their own in the run's Ray graph (``judge_hf_checkpoint``; started
by :mod:`raygym.run.aux_groups` on their own GPUs) serving the same ``/generate`` API as the rollout
engines. ``rm_type='judge'`` scores every sample with :meth:`JudgeClient.score_samples`.

Per sample the template (``judge_prompt_template``, with ``{prompt}``, ``{response}``, ``{label}``) is
filled, rendered with the judge tokenizer's chat template when it has one, and sent greedily
(temperature 0, ``judge_max_response_len`` tokens). The reward is the first number of the judge's
answer mapped from [``judge_score_min``, ``judge_score_max``] to [0, 1]; an answer without a number in
that range gets ``judge_failure_score`` (and counts in ``judge/parse_failures``). Requests from all
groups of a step are pooled into ``/generate`` batches of up to ``judge_batch_size`` prompts, spread
over the judge engines; identical (prompt, response, label) triples are judged once
(``judge_cache_size`` entries, least recently used dropped first).

>>> parse_score("Score: 8/10", 0, 10), parse_score("no idea", 0, 10), parse_score("42", 0, 10)
(0.8, None, None)
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raygym.config.recipe import Recipe
from raygym.config.views import build_view, recipe_view
from raygym.engine_api.protocol import GenerateRequest
from raygym.types import Sample

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@recipe_view()
@dataclass(frozen=True)
class JudgeSettings:
    """The recipe's ``judge_*`` fields the judge client reads (see :mod:`raygym.config.views`)."""

    judge_prompt_template: str
    judge_max_response_len: int
    judge_score_min: float
    judge_score_max: float
    judge_failure_score: float
    judge_batch_size: int
    judge_cache_size: int

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> JudgeSettings:
        return build_view(cls, recipe)


def parse_score(text: str, low: float, high: float) -> float | None:
    """The first number of ``text`` mapped from [low, high] to [0, 1]; None when there is none or it is
    out of range."""
    found = _NUMBER.search(text)
    if found is None:
        return None
    value = float(found.group(0))
    if not low <= value <= high:
        return None
    return (value - low) / (high - low)


def render_prompt(settings: JudgeSettings, tokenizer: Any, prompt: Any, response: str, label: Any) -> list[int]:
    """Token ids of the judge prompt for one sample (chat template applied when the tokenizer has one)."""
    prompt_text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
    text = settings.judge_prompt_template.format(prompt=prompt_text, response=response,
                                           label="" if label is None else label)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


class JudgeClient:
    """Scores samples with the judge engines (``EngineActor`` handles, or ``clients``: objects with an async
    ``generate(GenerateRequest)`` such as :class:`raygym.engine_api.client.EngineClient`)."""

    def __init__(self, settings: JudgeSettings, tokenizer: Any, *, engines: Sequence[Any] = (),
                 clients: Sequence[Any] = (), linger_s: float = 0.005) -> None:
        if not engines and not clients:
            raise ValueError("JudgeClient needs judge engines or clients")
        self.settings = settings
        self.tokenizer = tokenizer
        self._engines = list(engines)
        self._clients: list[Any] = list(clients)
        self.linger_s = linger_s
        self._cache: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._queue: list[tuple[list[int], asyncio.Future[str]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._next = 0
        self._counts = {"requests": 0, "batches": 0, "cache_hits": 0, "parse_failures": 0, "errors": 0}

    async def _ensure_clients(self) -> None:
        if not self._clients:
            from raygym.engine_api.client import EngineClient

            urls = await asyncio.gather(*(h.url.remote() for h in self._engines))
            self._clients = [EngineClient(url) for url in urls]

    async def close(self) -> None:
        if self._engines:  # clients we made ourselves
            for client in self._clients:
                await client.aclose()
            self._clients = []

    def metrics(self) -> dict[str, float]:
        """``judge/*`` counters since the last call (then reset)."""
        out = {f"judge/{k}": float(v) for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    async def score_samples(self, samples: list[Sample]) -> list[float]:
        """One reward per sample (a batched ``custom_rm_function``)."""
        return list(await asyncio.gather(*(self.score(s.prompt, s.response_text, s.label) for s in samples)))

    async def score(self, prompt: Any, response: str, label: Any) -> float:
        """The judge's reward for one (prompt, response, label)."""
        key = (repr(prompt), response, repr(label))
        if key in self._cache:
            self._cache.move_to_end(key)
            self._counts["cache_hits"] += 1
            return self._cache[key]
        ids = render_prompt(self.settings, self.tokenizer, prompt, response, label)
        try:
            answer = await self._submit(ids)
        except Exception:  # an unreachable judge must not stop the run: the failure score, counted
            self._counts["errors"] += 1
            return self.settings.judge_failure_score
        value = parse_score(answer, self.settings.judge_score_min, self.settings.judge_score_max)
        if value is None:
            self._counts["parse_failures"] += 1
            value = self.settings.judge_failure_score
        if self.settings.judge_cache_size:
            self._cache[key] = value
            while len(self._cache) > self.settings.judge_cache_size:
                self._cache.popitem(last=False)
        return value

    async def _submit(self, ids: list[int]) -> str:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.append((ids, future))
        self._counts["requests"] += 1
        if len(self._queue) >= self.settings.judge_batch_size:
            self._flush_now()
        elif self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_later())
        return await future

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.linger_s)  # let the other groups of the step join this batch
        self._flush_now()

    def _flush_now(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.settings.judge_batch_size], self._queue[self.settings.judge_batch_size:]
            asyncio.create_task(self._send(batch))

    async def _send(self, batch: list[tuple[list[int], asyncio.Future[str]]]) -> None:
        try:
            await self._ensure_clients()
            client = self._clients[self._next % len(self._clients)]
            self._next += 1
            params = {"temperature": 0.0, "max_new_tokens": self.settings.judge_max_response_len}
            answers = await client.generate(GenerateRequest(input_ids=[ids for ids, _ in batch],
                                                            sampling_params=[params] * len(batch)))
            self._counts["batches"] += 1
            if not isinstance(answers, list) or len(answers) != len(batch):
                raise RuntimeError(f"the judge answered {len(batch)} prompts with {answers!r:.200}")
            for (_, future), answer in zip(batch, answers, strict=True):
                if not future.done():
                    future.set_result(answer.text)
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
