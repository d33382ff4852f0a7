"""Rewards: built-in verifiers selected by ``rm_type`` and custom reward callables.

Built-ins (``rm_type``): ``math`` (final ``\\boxed{}`` answer, else the last number, compared after
normalisation), ``gsm8k`` (label ``"... #### N"``; the response's ``#### N`` or last number),
``exact`` (stripped string equality) and ``next_digit`` (the builtin task).

Custom reward functions (``custom_rm_function``: a callable or ``"pkg.mod:fn"``, sync or async).
The calling convention is read from the signature, in this order:

1. batched — ``fn.batched = True`` or a first parameter named ``samples``:
   ``fn(samples: list[Sample]) -> list[float]`` (one call per group of samples);
2. TRL style — every parameter is named from ``prompt, response, label, metadata`` (any subset,
   passed by name): ``fn(prompt, response, label, metadata) -> float``;
3. per sample — one parameter (any other name): ``fn(sample: Sample) -> float``.

A reward function that raises (or times out) gives reward 0.0 and records ``"Type: message"`` in
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
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from fractions import Fraction
from typing import Any

from raygym.config import load_callable
from raygym.errors import ConfigError
from raygym.types import Sample

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_GSM8K_ANSWER = re.compile(r"####\s*(\S+)")
TRL_PARAMS = ("prompt", "response", "label", "metadata")


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


BUILTIN_REWARDS: dict[str, Callable[[str, Any], float]] = {
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "exact": exact_reward,
    "next_digit": next_digit_reward,
}


def reward_convention(fn: Callable[..., Any]) -> str:
    """``"batched"``, ``"trl"`` or ``"sample"``: how :class:`RewardModel` calls ``fn`` (module docs)."""
    if getattr(fn, "batched", False):
        return "batched"
    params = [
        p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if params and params[0].name == "samples":
        return "batched"
    if params and all(p.name in TRL_PARAMS for p in params):
        return "trl"
    required = [p for p in params if p.default is p.empty]
    if len(required) == 1 or (len(params) >= 1 and not required):
        return "sample"
    raise ConfigError(
        f"custom_rm_function={getattr(fn, '__qualname__', fn)!r}: unsupported signature {inspect.signature(fn)}; "
        "use fn(sample), fn(prompt, response, label, metadata) or fn(samples) with fn.batched = True"
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class RewardModel:
    """Scores samples in place (``sample.reward`` / ``sample.reward_error``) with a built-in
    ``rm_type`` or a custom function, off the event loop.

    >>> import asyncio
    >>> s = Sample(prompt="q", prompt_tokens=[], group_index=0, response_text="#### 7", label="x #### 7")
    >>> asyncio.run(RewardModel(rm_type="gsm8k").score([s])); s.reward
    1.0
    """

    def __init__(
        self,
        rm_type: str | None = None,
        custom_rm_function: Callable[..., Any] | str | None = None,
        post_process_function: Callable[..., Any] | str | None = None,
        *,
        executor: Executor | None = None,
        timeout: float | None = None,
    ) -> None:
        custom = load_callable(custom_rm_function, "custom_rm_function")
        if custom is None:
            if rm_type is None:
                raise ConfigError("rm_type=None and no custom_rm_function: set rm_type to one of "
                                  f"{sorted(BUILTIN_REWARDS)} or give a custom_rm_function")
            if rm_type not in BUILTIN_REWARDS:
                raise ConfigError(f"rm_type={rm_type!r}: unknown reward; use one of {sorted(BUILTIN_REWARDS)} "
                                  "or a custom_rm_function")
            builtin = BUILTIN_REWARDS[rm_type]
            self._fn: Callable[..., Any] = lambda sample: builtin(sample.response_text, sample.label)
            self.convention = "sample"
        else:
            self._fn, self.convention = custom, reward_convention(custom)
        self._post = load_callable(post_process_function, "custom_reward_post_process_function")
        self._executor = executor or ThreadPoolExecutor(max_workers=4, thread_name_prefix="raygym-reward")
        self.timeout = timeout

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(self._fn):
            result = self._fn(*args, **kwargs)
        else:
            loop = asyncio.get_running_loop()
            result = loop.run_in_executor(self._executor, lambda: self._fn(*args, **kwargs))
        return await asyncio.wait_for(result, self.timeout) if self.timeout else await result

    async def _score_one(self, sample: Sample) -> None:
        try:
            if self.convention == "trl":
                names = inspect.signature(self._fn).parameters
                values = {"prompt": sample.prompt, "response": sample.response_text, "label": sample.label,
                          "metadata": sample.metadata}
                value = await self._call(**{k: v for k, v in values.items() if k in names})
            else:
                value = await self._call(sample)
            sample.reward, sample.reward_error = float(value), None
        except Exception as e:  # a user's verifier failing must not stop the run
            sample.reward, sample.reward_error = 0.0, _error_text(e)

    async def score(self, samples: Sequence[Sample]) -> None:
        """Set ``reward`` (and ``reward_error`` on failure) on every sample; never raises for a
        failing reward function."""
        if not samples:
            return
        if self.convention != "batched":
            await asyncio.gather(*(self._score_one(s) for s in samples))
            return
        try:
            values = list(await self._call(list(samples)))
            if len(values) != len(samples):
                raise ValueError(f"batched reward returned {len(values)} rewards for {len(samples)} samples")
            for s, v in zip(samples, values, strict=True):
                s.reward, s.reward_error = float(v), None
        except Exception as e:
            for s in samples:
                s.reward, s.reward_error = 0.0, _error_text(e)

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


def reward_model_from_config(cfg: Any, executor: Executor | None = None) -> RewardModel:
    """The :class:`RewardModel` of a ``TrainConfig``'s recipe (rm_type / custom functions).

    With neither ``rm_type`` nor ``custom_rm_function`` set, a ``builtin:next-digit`` dataset uses
    ``next_digit``."""
    recipe = getattr(cfg, "recipe", cfg)
    rm_type = getattr(recipe, "rm_type", None)
    custom = getattr(recipe, "custom_rm_function", None)
    if rm_type is None and custom is None:
        from raygym.builtin import NEXT_DIGIT_TASK

        if getattr(getattr(cfg, "dataset", None), "prompt_data", None) == NEXT_DIGIT_TASK:
            rm_type = "next_digit"
    return RewardModel(rm_type, custom, getattr(recipe, "custom_reward_post_process_function", None),
                       executor=executor)
