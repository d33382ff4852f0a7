"""Rewards: built-in verifiers selected by ``rm_type``, custom reward functions, and weighted sums.

Built-ins (``rm_type``): ``math`` (final ``\\boxed{}`` answer, else the last number, compared after
normalisation), ``math_verify`` (the ``math-verify`` package: LaTeX, sets, intervals, symbolic
equality; ``pip install 'raygym[math]'``), ``gsm8k`` (label ``"... #### N"``; the response's ``#### N``
or last number), ``exact`` (stripped string equality), ``next_digit`` and ``long_tail`` (the builtin tasks),
``reasoning_gym`` (rows made from ``reasoning-gym:<task>``, scored by the task's own scorer; see
:mod:`raygym.envs.reasoning_gym_tasks`).

Custom reward functions (``custom_rm_function``: a callable or ``"pkg.mod:fn"``, sync or async) are
called the way their signature says: raygym's ``fn(sample)``, ``fn(prompt, response, label,
metadata)`` or batched ``fn(samples)``, TRL's ``fn(prompts, completions, **columns) -> list[float |
None]`` and verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (see
:mod:`raygym.rewards.signatures`). ``reward_functions`` sums several, with weights
(``{"gsm8k": 1.0, "my_pkg.rewards:format_reward": 0.2}``); each one's mean is logged as
``rollout/reward/<name>``. A function may give a sample no reward (``None``, TRL's convention): it then
adds nothing to that sample's sum.

A reward function that raises (or times out) gives 0.0 and records ``"Type: message"`` in
``Sample.reward_error``; it never stops the run. Sync functions run in a thread pool (or the
``executor`` given) so slow verifiers never block the event loop that drives generation; pass a
``ProcessPoolExecutor`` for CPU-heavy verifiers (the function must then be importable/picklable).

>>> math_reward("so the answer is \\\\boxed{1/2}", "0.5")
1.0
>>> gsm8k_reward("3 + 4 = 7 apples", "#### 7")
1.0
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from raygym.callables import load_callable
from raygym.config import RM_TYPES
from raygym.errors import ConfigError
from raygym.rewards.signatures import (
    PER_GROUP,
    accepted,
    fields_arguments,
    function_name,
    reward_convention,
    trl_arguments,
    verl_arguments,
)
from raygym.types import Sample

if TYPE_CHECKING:
    from raygym.config import Recipe, TrainConfig

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K_ANSWER = re.compile(r"####\s*(\S+)")


def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (integers, decimals, thousands commas, simple fractions)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def normalize_answer(answer: str) -> str:
    """Canonical text of an answer: no ``$``, commas, spaces or ``\\text``/``\\left`` noise; numbers
    (including ``a/b``, ``\\frac{a}{b}``, ``12.0``) in lowest exact form, so ``"1/2" == "0.5"``.

    >>> normalize_answer(" $1,000.00 "), normalize_answer("\\\\frac{3}{6}"), normalize_answer("0.5")
    ('1000', '1/2', '1/2')
    """
    s = answer.strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", s)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\$", "$", ",", " "):
        s = s.replace(noise, "")
    s = _unwrap_braces(s.rstrip("."))
    number = _as_fraction(s)
    if number is None:
        return s.lower()
    return str(number.numerator) if number.denominator == 1 else f"{number.numerator}/{number.denominator}"


def _unwrap_braces(s: str) -> str:
    """Drop braces that wrap the whole string (``{{42}}`` -> ``42``), not ``{x}+{y}``."""
    while s.startswith("{") and s.endswith("}"):
        depth = 0
        for i, ch in enumerate(s):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0 and i < len(s) - 1:
                return s
        s = s[1:-1]
    return s


def _as_fraction(s: str) -> Fraction | None:
    s = s.rstrip("%")
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)(/-?\d+(\.\d*)?)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: Any) -> float:
    """1.0 if the final boxed answer (else the last number) equals ``label`` after normalisation."""
    predicted = extract_boxed(response)
    if predicted is None:
        predicted = extract_last_number(response)
    if predicted is None:
        return 0.0
    truth = str(label)
    truth = extract_boxed(truth) or truth
    return 1.0 if normalize_answer(predicted) == normalize_answer(truth) else 0.0


def gsm8k_label(label: Any) -> str:
    """The final answer of a GSM8K label: the text after ``####`` (or the whole label)."""
    text = str(label)
    match = _GSM8K_ANSWER.findall(text)
    return match[-1] if match else text.strip()


def gsm8k_reward(response: str, label: Any) -> float:
    """1.0 if the response's ``#### N`` (else its last number) equals the label's ``#### N``."""
    marked = _GSM8K_ANSWER.findall(response)
    predicted = marked[-1] if marked else extract_last_number(response)
    if predicted is None:
        return 0.0
    return 1.0 if normalize_answer(predicted) == normalize_answer(gsm8k_label(label)) else 0.0


def exact_reward(response: str, label: Any) -> float:
    """1.0 if the stripped response equals the stripped label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


def next_digit_reward(response: str, label: Any) -> float:
    """The builtin ``next-digit`` task's reward (see :mod:`raygym.builtin`)."""
    from raygym.builtin import next_digit_reward as reward

    return reward(response, str(label))


def long_tail_reward(response: str, label: Any) -> float:
    """The builtin ``long-tail`` task's reward (see :mod:`raygym.builtin`)."""
    from raygym.builtin import long_tail_reward as reward

    return reward(response, str(label))


def count_shapes_reward(response: str, label: Any) -> float:
    """The builtin ``count-shapes`` visual task's reward (see :mod:`raygym.builtin.count_shapes`)."""
    from raygym.builtin.count_shapes import count_shapes_reward as reward

    return reward(response, str(label))


def reasoning_gym_reward(response: str, label: Any, metadata: Any = None) -> float:
    """A ``reasoning-gym`` task's own scorer (see :mod:`raygym.envs.reasoning_gym_tasks`)."""
    from raygym.envs.reasoning_gym_tasks import reasoning_gym_reward as reward

    return reward(response, label, metadata)


def math_verify_reward(response: str, label: Any) -> float:
    """1.0 if the ``math-verify`` package finds the response's answer equal to the label (a GSM8K
    ``#### N`` label is read as N). Needs ``pip install 'raygym[math]'``.

    math-verify bounds its work with ``SIGALRM``, which only the main thread may set: elsewhere (the
    reward thread pool) it runs without its own timeout, and the reward model's ``timeout`` applies.
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ConfigError(
            "rm_type='math_verify' needs the math-verify package: pip install 'raygym[math]' "
            "(or use --rm-type math, raygym's own normaliser)"
        ) from exc
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    truth = str(label)
    if "####" in truth:
        truth = gsm8k_label(truth)
    gold = parse(truth, parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "math": math_reward,
    "math_verify": math_verify_reward,
    "gsm8k": gsm8k_reward,
    "exact": exact_reward,
    "next_digit": next_digit_reward,
    "long_tail": long_tail_reward,
    "count_shapes": count_shapes_reward,
    "reasoning_gym": reasoning_gym_reward,
}
METADATA_REWARDS = frozenset({"reasoning_gym"})  # built-ins that also read the row's metadata
assert tuple(BUILTIN_REWARDS) == RM_TYPES, "raygym.config.RM_TYPES lists the built-in rewards"


def rm_type_choices() -> str:
    """The built-in reward names, for messages: ``'math', 'math_verify', ...``."""
    return ", ".join(repr(name) for name in RM_TYPES)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class RewardFunction:
    """One reward function of a run: ``name`` (its metric: ``rollout/reward/<name>``), the callable,
    how it is called (:mod:`raygym.rewards.signatures`), its weight in the sum, and where it came from
    (``"rm_type"``, an import path, or ``"callable"``)."""

    name: str
    fn: Callable[..., Any]
    convention: str
    weight: float = 1.0
    source: str = "callable"

    @property
    def per_group(self) -> bool:
        return self.convention in PER_GROUP


def _builtin(name: str, weight: float = 1.0) -> RewardFunction:
    if name not in BUILTIN_REWARDS:
        raise ConfigError(f"rm_type={name!r}: unknown reward; use one of {rm_type_choices()} "
                          "(--rm-type) or a custom_rm_function")
    if name == "math_verify":
        import importlib.util

        if importlib.util.find_spec("math_verify") is None:
            math_verify_reward("", "")  # raises the ConfigError naming the extra
    builtin = BUILTIN_REWARDS[name]
    if name in METADATA_REWARDS:
        return RewardFunction(name, lambda sample: builtin(sample.response_text, sample.label, sample.metadata),
                              "sample", weight, "rm_type")
    return RewardFunction(name, lambda sample: builtin(sample.response_text, sample.label), "sample", weight,
                          "rm_type")


def _custom(spec: Callable[..., Any] | str, field: str, weight: float = 1.0) -> RewardFunction:
    fn = load_callable(spec, field)
    assert fn is not None
    source = spec if isinstance(spec, str) else "callable"
    return RewardFunction(function_name(fn), fn, reward_convention(fn, field), weight, source)


def resolve_reward_functions(
    rm_type: str | None = None,
    custom_rm_function: Callable[..., Any] | str | None = None,
    reward_functions: Mapping[str, float] | None = None,
) -> list[RewardFunction]:
    """The reward functions a run sums: ``reward_functions`` ({built-in name or import path: weight})
    when set, else ``custom_rm_function``, else the built-in ``rm_type``. Imports them and reads their
    signatures, so a bad path or an unusable signature is a ConfigError now, not a 0.0 per sample later.

    >>> [(f.name, f.weight, f.convention) for f in resolve_reward_functions(reward_functions={"gsm8k": 1.0, "exact": 0.5})]
    [('gsm8k', 1.0, 'sample'), ('exact', 0.5, 'sample')]
    """
    if reward_functions:
        out: list[RewardFunction] = []
        for key, weight in reward_functions.items():
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
                raise ConfigError(f"reward_functions[{key!r}]={weight!r}: a weight must be a finite number")
            if key in BUILTIN_REWARDS:
                out.append(_builtin(key, float(weight)))
            else:
                out.append(_custom(key, f"reward_functions[{key!r}]", float(weight)))
        names = [f.name for f in out]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"reward_functions: two functions are named {twice[0]!r}; their metrics "
                              f"(rollout/reward/{twice[0]}) would collide; rename one")
        return out
    if custom_rm_function is not None and custom_rm_function != "":
        return [_custom(custom_rm_function, "custom_rm_function")]
    if rm_type is None:
        raise ConfigError(f"rm_type=None and no custom_rm_function: the run has no reward; pass --rm-type "
                          f"with one of {rm_type_choices()}, or --custom-rm-function pkg.module:function")
    return [_builtin(rm_type)]


Scores = list[tuple[float | None, str | None]]  # per sample: (value or None, error text or None)


class RewardModel:
    """Scores samples in place (``sample.reward``, ``sample.reward_components``, ``sample.reward_error``)
    with a built-in ``rm_type``, a custom function or a weighted sum of several, off the event loop.

    >>> import asyncio
    >>> s = Sample(prompt="q", prompt_tokens=[], group_index=0, response_text="#### 7", label="x #### 7")
    >>> asyncio.run(RewardModel(rm_type="gsm8k").score([s])); s.reward, s.reward_components
    (1.0, {'gsm8k': 1.0})
    """

    def __init__(
        self,
        rm_type: str | None = None,
        custom_rm_function: Callable[..., Any] | str | None = None,
        post_process_function: Callable[..., Any] | str | None = None,
        *,
        reward_functions: Mapping[str, float] | None = None,
        executor: Executor | None = None,
        timeout: float | None = None,
    ) -> None:
        self.functions = resolve_reward_functions(rm_type, custom_rm_function, reward_functions)
        self._post = load_callable(post_process_function, "custom_reward_post_process_function")
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="raygym-reward")
        self.timeout = timeout

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    @property
    def convention(self) -> str:
        """The single function's convention; ``"batched"`` for a sum that holds a per-group function."""
        if len(self.functions) == 1:
            return self.functions[0].convention
        return "batched" if self.per_group else "sample"

    @property
    def per_group(self) -> bool:
        """True when some function must see a whole group at once (score groups, not single samples)."""
        return any(f.per_group for f in self.functions)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            result = fn(*args, **kwargs)
        else:
            loop = asyncio.get_running_loop()
            result = loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        return await asyncio.wait_for(result, self.timeout) if self.timeout else await result

    @staticmethod
    def _as_reward(value: Any, allow_none: bool) -> float | None:
        if isinstance(value, dict) and "score" in value:  # verl may return {"score": ..., other metrics}
            value = value["score"]
        if value is None:
            if allow_none:
                return None
            raise TypeError("returned None; return a float (None means 'no reward' only in a list of rewards)")
        return float(value)

    async def _one(self, f: RewardFunction, sample: Sample) -> tuple[float | None, str | None]:
        try:
            if f.convention == "sample":
                value = await self._call(f.fn, sample)
            elif f.convention == "verl":
                value = await self._call(f.fn, **accepted(f.fn, verl_arguments(sample)))
            else:
                value = await self._call(f.fn, **accepted(f.fn, fields_arguments(sample)))
            return self._as_reward(value, allow_none=False), None
        except Exception as e:  # a user's verifier failing must not stop the run
            return 0.0, _error_text(e)

    async def _group(self, f: RewardFunction, samples: list[Sample]) -> Scores:
        try:
            if f.convention == "trl":
                values = await self._call(f.fn, **accepted(f.fn, trl_arguments(samples)))
            else:
                values = await self._call(f.fn, list(samples))
            values = list(values)
            if len(values) != len(samples):
                raise ValueError(f"{f.name} returned {len(values)} rewards for {len(samples)} samples")
            return [(self._as_reward(v, allow_none=True), None) for v in values]
        except Exception as e:
            return [(0.0, _error_text(e))] * len(samples)

    async def _scores(self, f: RewardFunction, samples: list[Sample]) -> Scores:
        if f.per_group:
            return await self._group(f, samples)
        return list(await asyncio.gather(*(self._one(f, s) for s in samples)))

    async def score(self, samples: Sequence[Sample]) -> None:
        """Set ``reward`` (the weighted sum of the functions that gave one; 0.0 when none did),
        ``reward_components`` and ``reward_error`` on every sample; never raises for a failing
        reward function."""
        samples = list(samples)
        if not samples:
            return
        results = await asyncio.gather(*(self._scores(f, samples) for f in self.functions))
        several = len(self.functions) > 1
        for i, s in enumerate(samples):
            total, errors, components = 0.0, [], {}
            for f, scores in zip(self.functions, results, strict=True):
                value, error = scores[i]
                components[f.name] = value
                if error is not None:
                    errors.append(f"{f.name}: {error}" if several else error)
                if value is not None:
                    total += f.weight * value
            s.reward, s.reward_components = total, components
            s.reward_error = "; ".join(errors) if errors else None

    def post_process(self, samples: Sequence[Sample]) -> None:
        """Apply ``custom_reward_post_process_function(samples) -> None | list[float]`` (it may edit the
        samples itself or return new rewards, one per sample)."""
        if self._post is None:
            return
        values = self._post(list(samples))
        if values is None:
            return
        values = list(values)
        if len(values) != len(samples):
            raise ConfigError(
                f"custom_reward_post_process_function returned {len(values)} rewards for {len(samples)} "
                "samples; return one per sample or None"
            )
        for s, v in zip(samples, values, strict=True):
            s.reward = float(v)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def reward_component_metrics(samples: Sequence[Sample], names: Sequence[str], prefix: str) -> dict[str, float]:
    """``<prefix>reward/<name>``: each function's mean over the samples it scored, and
    ``<prefix>reward_none``: how many samples no function gave a reward.

    >>> s = Sample(prompt="q", prompt_tokens=[], group_index=0, reward_components={"a": 1.0, "b": None})
    >>> reward_component_metrics([s], ["a", "b"], "rollout/")
    {'rollout/reward/a': 1.0, 'rollout/reward_none': 0.0}
    """
    out: dict[str, float] = {}
    for name in names:
        values = [s.reward_components.get(name) for s in samples]
        given = [v for v in values if v is not None]
        if given:
            out[f"{prefix}reward/{name}"] = sum(given) / len(given)
    none = sum(1 for s in samples if s.reward_components and all(v is None for v in s.reward_components.values()))
    out[f"{prefix}reward_none"] = float(none)
    return out


def default_rm_type(recipe: Recipe, prompt_data: str | None) -> str | None:
    """``recipe.rm_type``, or the builtin task's own reward (``next_digit``, ``long_tail``; ``reasoning_gym`` for
    ``reasoning-gym:`` data) when no reward is set."""
    from raygym.builtin import BUILTIN_TASKS
    from raygym.envs.reasoning_gym_tasks import is_task_uri

    if recipe.rm_type is None and not recipe.custom_rm_function and not recipe.reward_functions:
        if prompt_data in BUILTIN_TASKS:
            return BUILTIN_TASKS[prompt_data]
        if is_task_uri(prompt_data):
            return "reasoning_gym"
    return recipe.rm_type


def reward_model_from_config(cfg: TrainConfig, executor: Executor | None = None) -> RewardModel:
    """The :class:`RewardModel` of a ``TrainConfig``: ``reward_functions``, else ``custom_rm_function``,
    else ``rm_type`` (the builtin dataset's own reward when unset)."""
    recipe = cfg.recipe
    return RewardModel(default_rm_type(recipe, cfg.dataset.prompt_data), recipe.custom_rm_function,
                       recipe.custom_reward_post_process_function,
                       reward_functions=recipe.reward_functions, executor=executor)
