"""Runs multi-turn episodes through the rollout engines, token in / token out.

:class:`EpisodeRunner` has the ``custom_generate_function`` signature, so the rollout manager calls
it once per sample (all samples of a step at once: many episodes in flight). Per turn it sends the
token ids of the whole context (prompt, earlier turns, observations) to ``/generate``, keeps the
engine's output ids and log-probs as they are (nothing the model produced is ever re-tokenised),
tokenises only the environment's observation, and builds the sample's ``loss_mask``: 1 for the
model's tokens, 0 for observation tokens (their log-probs are recorded as 0.0).

Limits: ``max_turns`` model turns; ``max_context_len`` tokens of prompt + response (each turn gets
``min(max_new_tokens, room left)`` tokens; an observation that does not fit is cut and the episode
ends with finish reason ``length``); ``call_timeout`` seconds for each ``reset`` / ``step`` (sync ones run in a
worker thread, so a slow environment never blocks the engines' other episodes). On a vision-language model, a
turn that sampled the image token (``<|image_pad|>``) is the episode's last, as if it were its ``max_turns``-th:
no engine takes that token back as text in a later turn's context (raygym's server and vLLM adapter refuse a
prompt whose pads outnumber its images' tokens; stock SGLang would read another image, refused before it is
sent), and one refused request would fail the whole rollout.

Per sample it records ``metadata["env_reward"]`` (the sum of the steps' rewards; the default
reward of an environment run, see :func:`episode_reward`) and ``metrics`` ``env_turns``,
``env_tool_calls``, ``env_tool_errors``, ``env_context_full`` and ``env_errors`` (averaged per step by the
manager as ``rollout/env_*``). An environment that raises (or times out) in ``reset`` or ``step`` ends only
its own episode: ``env_errors`` is 1, ``metadata["env_error"]`` says what happened, the reward is 0 and the
loss mask is all 0 (nothing of a broken episode is trained).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from raygym.engine_api.protocol import GenerateResponse
from raygym.envs.base import Environment, Step
from raygym.errors import RaygymError
from raygym.types import Sample

Generate = Callable[[list[int], dict[str, Any]], Awaitable[GenerateResponse]]
ENV_CALL_TIMEOUT_S = 300.0  # one reset or step; past it the episode counts as an environment error


class EnvCallError(Exception):
    """An environment's own code failed (raised, or took longer than its timeout) during one episode."""


async def call_env(fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
    """Call an environment method ``fn(*args)``: coroutine functions on the event loop, plain ones in a worker
    thread (an awaitable they return is awaited too), both within ``timeout`` seconds. Any failure is an
    :class:`EnvCallError` naming ``what``."""
    async def run() -> Any:
        value = fn(*args) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, *args)
        return await value if inspect.isawaitable(value) else value

    try:
        return await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        raise EnvCallError(f"{what} took longer than {timeout:g} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise EnvCallError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def engine_output(response: GenerateResponse) -> tuple[list[int], list[float]]:
    """The ids and log-probs of one ``/generate`` answer, exactly as the engine sampled them (0.0 each when the
    answer carries none)."""
    ids, logprobs = response.tokens_and_logprobs()
    return ids, logprobs or [0.0] * len(ids)


def finish_reason(response: GenerateResponse) -> str:
    """The ``finish_reason`` type of one ``/generate`` answer (``stop``, ``length``, ``abort``)."""
    return response.finish_type


@dataclass
class EpisodeTokens:
    """An episode's response side as it grows: the model's tokens (mask 1, the engine's log-probs) and
    observation tokens (mask 0, log-prob 0.0), in order."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add_model(self, ids: list[int], logprobs: list[float]) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs

    def add_observation(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def write(self, sample: Sample, tokenizer: Any, *, trained: bool = True) -> None:
        """Put the tokens into ``sample`` (``trained=False``: a loss mask of zeros)."""
        sample.response_tokens, sample.rollout_log_probs = list(self.tokens), list(self.logprobs)
        sample.loss_mask = list(self.mask) if trained else [0] * len(self.mask)
        sample.response_text = tokenizer.decode(self.tokens, skip_special_tokens=True)


def mark_env_error(sample: Sample, message: str) -> None:
    """Record an environment failure on ``sample``: reward 0, ``env_errors`` 1, ``metadata["env_error"]``."""
    sample.metadata = {**sample.metadata, "env_reward": 0.0, "env_error": message}
    sample.metrics["env_errors"] = 1.0


class EpisodeRunner:
    """``custom_generate_function`` that plays one episode of ``env_factory()`` per sample.

    >>> runner = EpisodeRunner(CalculatorEnv, tokenizer, max_turns=3, max_context_len=200)  # doctest: +SKIP
    >>> sample = await runner(cfg, sample, {"max_new_tokens": 8}, generate)               # doctest: +SKIP
    """

    def __init__(self, env_factory: Callable[[], Environment], tokenizer: Any, *, max_turns: int,
                 max_context_len: int | None = None, call_timeout: float = ENV_CALL_TIMEOUT_S) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1")
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_context_len = max_context_len
        self.call_timeout = call_timeout
        self.image_token = _image_token(tokenizer)  # a vision-language model's <|image_pad|> (module docstring)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _room(self, prompt: list[int], episode: EpisodeTokens) -> int | None:
        return None if self.max_context_len is None else self.max_context_len - len(prompt) - len(episode.tokens)

    async def __call__(self, args: Any, sample: Sample, sampling_params: dict[str, Any], generate: Generate) -> Sample:
        episode = EpisodeTokens()
        stats = {"env_turns": 0.0, "env_tool_calls": 0.0, "env_tool_errors": 0.0, "env_context_full": 0.0,
                 "env_errors": 0.0}
        try:
            reward, finish = await self._play(sample, sampling_params, generate, episode, stats)
        except EnvCallError as exc:
            episode.write(sample, self.tokenizer, trained=False)
            sample.finish_reason = "stop"
            sample.metrics.update(stats)
            mark_env_error(sample, str(exc))
            return sample
        episode.write(sample, self.tokenizer)
        sample.finish_reason = finish
        sample.metadata = {**sample.metadata, "env_reward": reward}
        sample.metrics.update(stats)
        return sample

    async def _play(self, sample: Sample, sampling_params: dict[str, Any], generate: Generate,
                    episode: EpisodeTokens, stats: dict[str, float]) -> tuple[float, str]:
        try:
            env = self.env_factory()
        except Exception as exc:
            raise EnvCallError(f"rollout_env's factory raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(env, Environment):
            raise RaygymError(f"rollout_env made a {type(env).__name__}; it must return a raygym.envs.Environment")
        name = type(env).__name__
        try:
            return await self._turns(env, name, sample, sampling_params, generate, episode, stats)
        finally:
            await call_env(env.aclose, timeout=self.call_timeout, what=f"{name}.aclose")

    async def _turns(self, env: Environment, name: str, sample: Sample, sampling_params: dict[str, Any],
                     generate: Generate, episode: EpisodeTokens, stats: dict[str, float]) -> tuple[float, str]:
        first = await call_env(env.reset, sample.prompt, sample.label, sample.metadata, timeout=self.call_timeout,
                               what=f"{name}.reset")
        if first is not None and not isinstance(first, str):
            raise EnvCallError(f"{name}.reset returned {type(first).__name__}; return None or the first observation")
        params = dict(sampling_params)
        params["stop"] = [*_as_list(params.get("stop")), *env.turn_stop]
        if not params["stop"]:
            del params["stop"]
        per_turn = int(params.get("max_new_tokens", 128))
        prompt = list(sample.prompt_tokens)
        if first and self._observe(prompt, episode, first):
            stats["env_context_full"] = 1.0
            return 0.0, "length"
        reward, finish = 0.0, "stop"
        for _ in range(self.max_turns):
            room = self._room(prompt, episode)
            if room is not None and room <= 0:
                stats["env_context_full"] = 1.0
                return reward, "length"
            params["max_new_tokens"] = per_turn if room is None else min(per_turn, room)
            response = await generate(prompt + episode.tokens, dict(params))
            finish = finish_reason(response)
            ids, logprobs = engine_output(response)
            episode.add_model(ids, logprobs)
            stats["env_turns"] += 1
            if finish == "abort":
                sample.status = "aborted"
                return reward, finish
            step = await call_env(env.step, self.tokenizer.decode(ids, skip_special_tokens=True),
                                  timeout=self.call_timeout, what=f"{name}.step")
            if not isinstance(step, Step):
                raise RaygymError(f"{name}.step returned {type(step).__name__}; return a raygym.envs.Step")
            reward += float(step.reward)
            stats["env_tool_calls"] += float(step.tool_call)
            stats["env_tool_errors"] += float(step.tool_error)
            if step.done or stats["env_turns"] == self.max_turns:  # no observation nobody would answer
                return reward, finish
            if self.image_token is not None and self.image_token in ids:  # no engine could take the next turn
                return reward, finish
            if self._observe(prompt, episode, step.observation):
                stats["env_context_full"] = 1.0
                return reward, "length"
        return reward, finish

    def _observe(self, prompt: list[int], episode: EpisodeTokens, text: str) -> bool:
        """Append an observation; True when it filled the context (cut to fit: the episode ends)."""
        observed = self._encode(text)
        room = self._room(prompt, episode)
        full = room is not None and len(observed) >= room  # no room for the model to answer it
        episode.add_observation(observed[:max(room, 0)] if full and room is not None else observed)
        return full


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _image_token(tokenizer: Any) -> int | None:
    """The id of ``<|image_pad|>`` in a vision-language model's tokenizer; None for a text model's."""
    from raygym.vision.qwen_vl import IMAGE_PAD

    try:
        token = tokenizer.get_vocab().get(IMAGE_PAD)
    except (AttributeError, NotImplementedError):
        return None
    return None if token is None else int(token)


def episode_reward(sample: Sample) -> float:
    """The reward of an environment run: the sum of its steps' rewards (``metadata["env_reward"]``)."""
    if "env_reward" not in sample.metadata:
        raise RaygymError("episode_reward: the sample has no env_reward; set rollout_env so episodes run "
                          "through raygym.envs")
    return float(sample.metadata["env_reward"])
