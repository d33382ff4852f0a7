"""``verifiers`` environments in raygym, unchanged: ``--rollout-env verifiers:<env id or module>``.

The environment's own rollout loop runs (``setup_state``, ``env_response``, its stop conditions, its parser and
rubric), with raygym's engines as the model behind it: :class:`VerifiersRunner` hands each episode a verifiers
``Client`` whose model calls go token in / token out through the rollout manager's routed ``/generate``
(:class:`raygym.envs.chat_tokens.ChatTokens`: the first prompt is rendered once, every later context is the exact
ids so far plus the new messages' ids; nothing the model wrote is re-tokenised). The sample keeps the engine's ids
and log-probs with loss mask 1 and the environment's messages with mask 0.

Rewards: the environment's rubric scores each group of samples (``rubric.score_group``, as verifiers does for
its own group rollouts, so group-relative reward functions work too); ``rm_type="env"`` (or unset) selects it. The
rubric's per-function scores are logged as ``rollout/verifiers/<name>``.

Supported: the classic ``verifiers`` API (``vf.Environment`` and its subclasses ``SingleTurnEnv``,
``MultiTurnEnv`` ...; verifiers 0.3.1 serves it as ``import verifiers as vf``). An environment that rewrites
earlier turns cannot run token in / token out and counts as an environment error; models' tool calls are not parsed
(``ToolEnv`` environments see text answers).

Data: ``--prompt-data verifiers:<...>`` is the environment's dataset (``#eval``: its eval dataset), rows
``{"prompt": messages, "label": answer, "metadata": {"verifiers": {example_id, task, info, ...}}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from raygym.envs.chat_tokens import ChatTokens
from raygym.envs.runner import (
    ENV_CALL_TIMEOUT_S,
    EpisodeTokens,
    Generate,
    engine_output,
    finish_reason,
    mark_env_error,
)
from raygym.envs.specs import EnvSpec
from raygym.errors import ConfigError, RaygymError
from raygym.types import Sample

METADATA_KEY = "verifiers"
_STATE_KEY = "verifiers_rollout"  # metadata entry naming the finished rollout the rubric scores
_INSTALL = "pip install 'raygym[verifiers]'"


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """verifiers' ``Environment`` installs SIGINT/SIGTERM handlers when it is built; keep raygym's (and work off
    the main thread, where ``signal.signal`` would raise)."""
    real = signal.signal
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}

    def register_nothing(signum: Any, handler: Any) -> Any:
        return signal.getsignal(signum)

    signal.signal = register_nothing  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = real
        for signum, handler in saved.items():
            if handler is not None:
                real(signum, handler)


def _vf() -> Any:
    try:
        import verifiers as vf
    except ImportError:
        raise ConfigError(f"verifiers environments need the verifiers package: {_INSTALL}") from None
    return vf


def load_environment(spec: EnvSpec, field_name: str = "rollout_env") -> Any:
    """Build the environment ``spec`` names (a ``vf.Environment``); ConfigError naming ``field_name`` when it
    cannot: verifiers not installed, no such module, no ``load_environment``, the loader raised, not a
    classic verifiers environment."""
    vf = _vf()
    where = f"{field_name}='verifiers:{spec.target}{':' + spec.attr if spec.attr else ''}'"
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise ConfigError(f"{where}: no module {spec.module!r} to load the environment from ({exc}); install the "
                          "environment's package or give an importable module path") from None
    name = spec.attr or "load_environment"
    factory: Any = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"{where}: module {spec.module!r} has no {name!r}; a verifiers environment module "
                              "defines load_environment(**kwargs)")
    try:
        with _own_signal_handlers():
            env = factory if isinstance(factory, vf.Environment) else factory(**spec.options)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{where}: building the environment raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"{where}: {name} gave a {type(env).__name__}, not a verifiers Environment "
                          "(vf.SingleTurnEnv, vf.MultiTurnEnv, ...); raygym runs the classic verifiers API")
    return env


# ── data ─────────────────────────────────────────────────────────────────────────────────────────


def _plain_message(message: Any) -> dict[str, Any]:
    if isinstance(message, dict):
        return {k: v for k, v in message.items() if v is not None}
    return {k: v for k, v in message.model_dump().items() if v is not None}


def environment_rows(env: Any, split: str = "train") -> list[dict[str, Any]]:
    """The environment's dataset (``split="eval"``: its eval dataset) as raygym prompt rows."""
    dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
    rows = []
    for record in dataset:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            prompt = [_plain_message(m) for m in prompt]
        extra = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
        rows.append({"prompt": prompt, "label": record.get("answer") or "",
                     "metadata": {METADATA_KEY: json.loads(json.dumps(extra, default=str))}})
    return rows


def materialize_environment_data(spec: EnvSpec, uri: str, directory: str | os.PathLike[str],
                                 field_name: str = "prompt_data") -> str:
    """Write the rows of the environment's dataset under ``directory`` (once per URI) and return the path."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    path = Path(directory) / f"verifiers-{spec.module}-{spec.split}-{digest}.jsonl"
    if not path.exists():
        rows = environment_rows(load_environment(spec, field_name), spec.split)
        if not rows:
            raise ConfigError(f"{field_name}={uri!r}: the environment's {spec.split} dataset is empty")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, path)
    return str(path)


def rollout_input(sample: Sample) -> dict[str, Any]:
    """The verifiers ``RolloutInput`` of a prompt row: prompt, answer and the row's ``metadata["verifiers"]``."""
    extra = dict(sample.metadata.get(METADATA_KEY) or {})
    extra.setdefault("example_id", sample.data_index)
    label = sample.label
    return {**extra, "prompt": sample.prompt, "answer": "" if label is None else str(label)}


# ── the model behind the environment ────────────────────────────────────────────────────────────────


class TurnLimit(Exception):
    """The episode used its model turns (raised inside the client; verifiers ends the rollout on it)."""


class Episode:
    """One rollout's model side: the context ids so far and the response tokens (mask 1 / 0) for the sample."""

    def __init__(self, tokenizer: Any, generate: Generate, params: dict[str, Any], *, max_turns: int,
                 max_context_len: int | None, chat_template_kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.generate, self.params = tokenizer, generate, params
        self.max_turns, self.max_context_len = max_turns, max_context_len
        self.chat_template_kwargs = chat_template_kwargs
        self.chat: ChatTokens | None = None
        self.prompt_ids: list[int] | None = None
        self.tokens = EpisodeTokens()
        self.seen: list[dict[str, Any]] = []  # the messages already in the context, as rendered
        self.last_ids: list[int] = []
        self.turns = 0
        self.context_full = False
        self.engine_error: BaseException | None = None  # re-raised after the rollout: the manager's to handle
        self.finish = "stop"

    def _text_only(self, messages: Sequence[dict[str, Any]]) -> bool:
        return all(m.get("role") == "text" for m in messages)

    def _render_text(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        text = "".join(str(m.get("content") or "") for m in messages)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] if text else []

    def _context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The ids to send for ``messages``: the first prompt rendered once, later only the new messages."""
        if self.prompt_ids is None:
            self.seen = list(messages)
            if self._text_only(messages):
                self.prompt_ids = self._render_text(messages)
            else:
                self.chat = ChatTokens(self.tokenizer, chat_template_kwargs=self.chat_template_kwargs, tools=tools)
                self.prompt_ids = self.chat.prompt_ids(messages)
            return list(self.prompt_ids)
        known = len(self.seen)
        if [(m.get("role"), m.get("content")) for m in messages[:known]] != \
                [(m.get("role"), m.get("content")) for m in self.seen]:
            raise RaygymError("the environment changed earlier turns of the conversation; raygym runs verifiers "
                              "environments token in / token out, which needs an append-only conversation")
        new = messages[known:]
        self.seen = list(messages)
        ids = self._render_text(new) if self.chat is None else self.chat.continuation_ids(self.last_ids, new)
        room = None if self.max_context_len is None else self.max_context_len - len(self.prompt_ids) - len(
            self.tokens.tokens)
        if room is not None and len(ids) >= room:
            self.tokens.add_observation(ids[:max(room, 0)])
            self.context_full = True
            raise TurnLimit("the environment's answer filled the context (rollout_env_max_context_len)")
        self.tokens.add_observation(ids)
        return self.prompt_ids + self.tokens.tokens

    async def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      stop: list[str]) -> tuple[str, list[int], list[int], list[float], str]:
        """Generate the model's next turn: (text, context ids sent, output ids, log-probs, finish reason)."""
        if self.turns >= self.max_turns:
            raise TurnLimit(f"the episode used its {self.max_turns} model turns")
        context = self._context(messages, tools)
        params = dict(self.params)
        per_turn = int(params.get("max_new_tokens", 128))
        if self.max_context_len is not None:
            room = self.max_context_len - len(context)
            if room <= 0:
                self.context_full = True
                raise TurnLimit("the context is full (rollout_env_max_context_len)")
            per_turn = min(per_turn, room)
        params["max_new_tokens"] = per_turn
        if stop:
            params["stop"] = [*_as_list(params.get("stop")), *stop]
        try:
            response = await self.generate(context, params)
        except Exception as exc:
            self.engine_error = exc
            raise
        ids, logprobs = engine_output(response)
        self.finish = finish_reason(response)
        self.tokens.add_model(ids, logprobs)
        self.last_ids = ids
        self.turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.seen.append({"role": "assistant", "content": text})
        return text, context, ids, logprobs, self.finish


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


@lru_cache(maxsize=1)
def _client_class() -> type:
    """verifiers' ``Client`` for one :class:`Episode` (built on first use: verifiers is an optional package)."""
    vf = _vf()
    from verifiers.types import Response, ResponseMessage, ResponseTokens, Usage

    class EpisodeClient(vf.Client):  # type: ignore[misc,name-defined]
        """Answers verifiers' model calls with raygym's engines, token in / token out."""

        def setup_client(self, config: Any) -> Any:
            raise RaygymError("raygym's verifiers client is built around an episode, not a ClientConfig")

        async def to_native_tool(self, tool: Any) -> dict[str, Any]:
            return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                     "parameters": tool.parameters}}

        async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            return [_plain_message(m) for m in messages], {}

        async def get_native_response(self, prompt: list[dict[str, Any]], model: str, sampling_args: Any,
                                      tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> Any:
            episode: Episode = self.client
            stop = _as_list((sampling_args or {}).get("stop"))
            try:
                text, context, ids, logprobs, finish = await episode.respond(prompt, tools, stop)
            except TurnLimit as exc:
                raise vf.OverlongPromptError(str(exc)) from exc
            truncated = finish == "length"
            tokens = ResponseTokens(prompt_ids=context, prompt_mask=[0] * len(context), completion_ids=ids,
                                    completion_mask=[1] * len(ids), completion_logprobs=logprobs)
            message = ResponseMessage(content=text, finish_reason="length" if truncated else "stop",
                                      is_truncated=truncated, tokens=tokens)
            usage = Usage(prompt_tokens=len(context), reasoning_tokens=0, completion_tokens=len(ids),
                          total_tokens=len(context) + len(ids))
            return Response(id=uuid.uuid4().hex, created=int(time.time()), model=model, usage=usage, message=message)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return EpisodeClient


class VerifiersRunner:
    """``custom_generate_function`` that plays one verifiers rollout per sample (see the module docstring); its
    :meth:`verifiers_rubric` is the run's reward function (per group)."""

    def __init__(self, spec: EnvSpec, tokenizer: Any, *, max_turns: int, max_context_len: int | None,
                 chat_template_kwargs: dict[str, Any] | None = None, call_timeout: float = ENV_CALL_TIMEOUT_S) -> None:
        self.env = load_environment(spec)
        self.tokenizer = tokenizer
        own = int(self.env.max_turns) if isinstance(getattr(self.env, "max_turns", None), int) else -1
        self.max_turns = own if own > 0 else max_turns  # the environment's own limit, else rollout_env_max_turns
        self.max_context_len = max_context_len
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.call_timeout = call_timeout
        self._states: dict[str, Any] = {}

    async def __call__(self, args: Any, sample: Sample, sampling_params: dict[str, Any], generate: Generate) -> Sample:
        episode = Episode(self.tokenizer, generate, dict(sampling_params), max_turns=self.max_turns,
                          max_context_len=self.max_context_len, chat_template_kwargs=self.chat_template_kwargs)
        client = _client_class()(episode)
        error: str | None = None
        state: Any = None
        try:
            state = await asyncio.wait_for(
                self.env.rollout(rollout_input(sample), client, "raygym", dict(self.env.sampling_args or {})),
                self.call_timeout * (self.max_turns + 1))
        except asyncio.TimeoutError:
            error = f"the verifiers rollout took longer than {self.call_timeout * (self.max_turns + 1):g} s"
        except Exception as exc:
            if episode.engine_error is not None:
                raise episode.engine_error from exc
            error = f"the verifiers environment raised {type(exc).__name__}: {exc}"
        if episode.engine_error is not None:
            raise episode.engine_error
        if error is None and state is not None and state.get("error") is not None:
            error = f"the verifiers environment failed: {type(state['error']).__name__}: {state['error']}"
        if episode.prompt_ids is not None:
            sample.prompt_tokens = list(episode.prompt_ids)  # the prompt the model saw, as the environment built it
        episode.tokens.write(sample, self.tokenizer, trained=error is None)
        sample.finish_reason = "length" if episode.context_full else episode.finish
        sample.metrics.update({"env_turns": float(episode.turns), "env_context_full": float(episode.context_full),
                               "env_errors": 0.0})
        if error is not None:
            mark_env_error(sample, error)
            return sample
        key = uuid.uuid4().hex
        self._states[key] = state
        sample.metadata = {**sample.metadata, _STATE_KEY: key}
        return sample

    async def verifiers_rubric(self, samples: list[Sample]) -> list[float]:
        """The environment's rubric over one group (``rubric.score_group``); 0.0 for episodes that failed."""
        keys = [s.metadata.pop(_STATE_KEY, None) for s in samples]
        states = [self._states.pop(k) for k in keys if k is not None]
        if states:
            await self.env.rubric.score_group(states)
            for state in states:
                await self.env.rubric.cleanup(state)
        scored = dict(zip([k for k in keys if k is not None], states, strict=True))
        rewards = []
        for sample, key in zip(samples, keys, strict=True):
            state = scored.get(key) if key is not None else None
            if state is None:
                rewards.append(0.0)
                continue
            reward = float(state.get("reward") or 0.0)
            sample.metadata["env_reward"] = reward
            for name, value in (state.get("metrics") or {}).items():
                if isinstance(value, (int, float)):
                    sample.metrics[f"verifiers/{name}"] = float(value)
            rewards.append(reward)
        return rewards

    def close(self) -> None:
        self._states.clear()
