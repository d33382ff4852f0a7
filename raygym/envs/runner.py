"""Runs multi-turn episodes through the rollout engines, token in / token out.

:class:`EpisodeRunner` has the ``custom_generate_function`` signature, so the rollout manager calls
it once per sample (all samples of a step at once: many episodes in flight). Per turn it sends the
token ids of the whole context (prompt, earlier turns, observations) to ``/generate``, keeps the
engine's output ids and log-probs as they are (nothing the model produced is ever re-tokenised),
tokenises only the environment's observation, and builds the sample's ``loss_mask``: 1 for the
model's tokens, 0 for observation tokens (their log-probs are recorded as 0.0).

Limits: ``max_turns`` model turns; ``max_context_len`` tokens of prompt + response (each turn gets
``min(max_new_tokens, room left)`` tokens; an observation that does not fit is cut and the episode
ends with finish reason ``length``).

Per sample it records ``metadata["env_reward"]`` (the sum of the steps' rewards; the default
reward of an environment run, see :func:`episode_reward`) and ``metrics`` ``env_turns``,
``env_tool_calls``, ``env_tool_errors`` and ``env_context_full`` (averaged per step by the manager
as ``rollout/env_*``).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from raygym.envs.base import Environment, Step
from raygym.errors import RaygymError
from raygym.types import Sample

Generate = Callable[[list[int], dict[str, Any]], Awaitable[dict[str, Any]]]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _finish(meta: dict[str, Any]) -> tuple[str, Any]:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return str(reason.get("type") or ""), reason.get("matched")
    return str(reason or ""), None


def _output(response: dict[str, Any]) -> tuple[list[int], list[float]]:
    entries = (response.get("meta_info") or {}).get("output_token_logprobs")
    if entries:
        return [int(e[1]) for e in entries], [float(e[0]) for e in entries]
    ids = [int(t) for t in response.get("output_ids") or []]
    return ids, [0.0] * len(ids)


class EpisodeRunner:
    """``custom_generate_function`` that plays one episode of ``env_factory()`` per sample.

    >>> runner = EpisodeRunner(CalculatorEnv, tokenizer, max_turns=3, max_context_len=200)  # doctest: +SKIP
    >>> sample = await runner(cfg, sample, {"max_new_tokens": 8}, generate)               # doctest: +SKIP
    """

    def __init__(self, env_factory: Callable[[], Environment], tokenizer: Any, *, max_turns: int,
                 max_context_len: int | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: must be >= 1")
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_context_len = max_context_len

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    async def __call__(self, args: Any, sample: Sample, sampling_params: dict[str, Any], generate: Generate) -> Sample:
        env = self.env_factory()
        if not isinstance(env, Environment):
            raise RaygymError(f"rollout_env made a {type(env).__name__}; it must return a raygym.envs.Environment")
        await _maybe_await(env.reset(sample.prompt, sample.label, sample.metadata))
        params = dict(sampling_params)
        params["stop"] = [*_as_list(params.get("stop")), *env.turn_stop]
        if not params["stop"]:
            del params["stop"]
        per_turn = int(params.get("max_new_tokens", 128))
        prompt = list(sample.prompt_tokens)
        tokens: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        reward, turns, calls, errors = 0.0, 0, 0, 0
        finish, context_full = "stop", False
        for _ in range(self.max_turns):
            room = None if self.max_context_len is None else self.max_context_len - len(prompt) - len(tokens)
            if room is not None and room <= 0:
                finish, context_full = "length", True
                break
            params["max_new_tokens"] = per_turn if room is None else min(per_turn, room)
            response = await generate(prompt + tokens, dict(params))
            finish, _matched = _finish(response.get("meta_info") or {})
            out, lps = _output(response)
            tokens += out
            mask += [1] * len(out)
            logprobs += lps
            turns += 1
            if finish == "abort":
                sample.status = "aborted"
                break
            step = await _maybe_await(env.step(self.tokenizer.decode(out, skip_special_tokens=True)))
            if not isinstance(step, Step):
                raise RaygymError(f"{type(env).__name__}.step returned {type(step).__name__}; return a raygym.envs.Step")
            reward += float(step.reward)
            calls += int(step.tool_call)
            errors += int(step.tool_error)
            if step.done or turns == self.max_turns:  # no observation nobody would answer
                break
            observed = self._encode(step.observation)
            if self.max_context_len is not None:
                room = self.max_context_len - len(prompt) - len(tokens)
                if len(observed) >= room:  # no room for the model to answer it
                    observed, finish, context_full = observed[:max(room, 0)], "length", True
            tokens += observed
            mask += [0] * len(observed)
            logprobs += [0.0] * len(observed)
            if context_full:
                break
        sample.response_tokens, sample.loss_mask, sample.rollout_log_probs = tokens, mask, logprobs
        sample.response_text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        sample.finish_reason = finish
        sample.metadata = {**sample.metadata, "env_reward": reward}
        sample.metrics.update({"env_turns": float(turns), "env_tool_calls": float(calls),
                               "env_tool_errors": float(errors), "env_context_full": float(context_full)})
        return sample


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def episode_reward(sample: Sample) -> float:
    """The reward of an environment run: the sum of its steps' rewards (``metadata["env_reward"]``)."""
    if "env_reward" not in sample.metadata:
        raise RaygymError("episode_reward: the sample has no env_reward; set rollout_env so episodes run "
                          "through raygym.envs")
    return float(sample.metadata["env_reward"])
