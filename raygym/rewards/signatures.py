"""How raygym calls a reward function, read from its signature once, at start-up.

Five conventions, recognised in this order:

``batched``  ``fn.batched = True`` or a first parameter named ``samples``:
             ``fn(samples: list[Sample]) -> list[float | None]``, one call per group of samples.
``verl``     parameters named ``solution_str`` and ``ground_truth`` (verl's ``compute_score``):
             ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``, per sample;
             a dict's ``"score"`` is the reward. ``ground_truth`` is the label (``label["ground_truth"]``
             when the label is verl's ``reward_model`` dict), ``data_source`` and ``extra_info`` come from
             the data columns of that name (else the row's metadata).
``trl``      a parameter named ``completions`` (TRL's ``reward_funcs``):
             ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, one call per
             group; every data column except the prompt's is passed by name as a list; ``None`` = this
             function gives that sample no reward. Chat prompts get chat completions
             (``[{"role": "assistant", "content": text}]``), as TRL does.
``fields``   every parameter named from ``prompt, response, label, metadata`` (any subset, by name):
             ``fn(prompt, response, label, metadata) -> float``, per sample. The built-in rewards
             (``raygym.rewards.scoring.BUILTIN_REWARDS``) are ``fn(response, label)``.
``sample``   one required parameter of any other name: ``fn(sample: Sample) -> float``, per sample.

Sync or async (``async def``) alike. Anything else is a :class:`ConfigError` naming the conventions.

>>> def accuracy(completions, solution, **kwargs): ...
>>> reward_convention(accuracy), missing_inputs(accuracy, "trl", columns=["question", "answer"])
('trl', ['solution'])
>>> reward_convention(lambda data_source, solution_str, ground_truth, extra_info=None: 0.0)
'verl'
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from raygym.errors import ConfigError

CONVENTIONS = ("batched", "verl", "trl", "fields", "sample")
PER_GROUP = frozenset({"batched", "trl"})
FIELD_PARAMS = ("prompt", "response", "label", "metadata")
TRL_GIVEN = ("prompts", "completions", "completion_ids")
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")

SUPPORTED = (
    "fn(sample) -> float; fn(prompt, response, label, metadata) -> float (any subset, by name); "
    "fn(samples) -> list[float] (or fn.batched = True); TRL's fn(prompts, completions, **columns) -> "
    "list[float | None]; verl's compute_score(data_source, solution_str, ground_truth, extra_info)"
)


def function_name(fn: Callable[..., Any]) -> str:
    """A short name for ``fn`` (its ``__name__``; a partial's function's; an object's class name)."""
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", None) or type(inner).__name__


def _named_params(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool]:
    """(parameters that take a value by position or name, whether ``fn`` takes ``**kwargs``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return [], False
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def reward_convention(fn: Callable[..., Any], field: str = "custom_rm_function") -> str:
    """``"batched"``, ``"verl"``, ``"trl"``, ``"fields"`` or ``"sample"``: how raygym calls ``fn``
    (module docs). ConfigError naming ``field`` for a signature none of them fits."""
    if getattr(fn, "batched", False):
        return "batched"
    params, _ = _named_params(fn)
    names = [p.name for p in params]
    if names and names[0] == "samples":
        return "batched"
    if "solution_str" in names and "ground_truth" in names:
        return "verl"
    if "completions" in names:
        return "trl"
    if names and all(n in FIELD_PARAMS for n in names):
        return "fields"
    required = [p for p in params if p.default is p.empty]
    if len(required) == 1 or (params and not required):
        return "sample"
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(?)"
    raise ConfigError(
        f"{field}={function_name(fn)!r}: unsupported signature {function_name(fn)}{signature}: raygym cannot "
        f"tell how to call it; write it as one of: {SUPPORTED}"
    )


def missing_inputs(fn: Callable[..., Any], convention: str, columns: Iterable[str]) -> list[str]:
    """Required parameters of a ``trl`` function that neither raygym nor the data columns supply
    (``[]`` for the other conventions, whose inputs are fixed)."""
    if convention != "trl":
        return []
    available = set(TRL_GIVEN) | set(columns)
    params, _ = _named_params(fn)
    return [p.name for p in params if p.default is p.empty and p.name not in available]


def accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``offered`` keyword arguments that ``fn`` takes (all of them with ``**kwargs``)."""
    params, var_keyword = _named_params(fn)
    if var_keyword:
        return dict(offered)
    names = {p.name for p in params}
    return {k: v for k, v in offered.items() if k in names}


def verl_arguments(sample: Any) -> dict[str, Any]:
    """verl's ``compute_score`` arguments for one sample."""
    columns = sample.columns or {}
    metadata = sample.metadata or {}
    label = sample.label
    ground_truth = label["ground_truth"] if isinstance(label, dict) and "ground_truth" in label else label
    extra_info = columns.get("extra_info", metadata or None)
    return {
        "data_source": columns.get("data_source", metadata.get("data_source", "")),
        "solution_str": sample.response_text,
        "ground_truth": ground_truth,
        "extra_info": extra_info,
    }


def trl_arguments(samples: list[Any]) -> dict[str, Any]:
    """TRL's reward-function keyword arguments for a group of samples: prompts, completions,
    completion_ids and one list per data column (None where a sample lacks the column)."""
    chat = any(isinstance(s.prompt, list) for s in samples)
    completions: list[Any] = [
        [{"role": "assistant", "content": s.response_text}] if chat else s.response_text for s in samples
    ]
    out: dict[str, Any] = {
        "prompts": [s.prompt for s in samples],
        "completions": completions,
        "completion_ids": [list(s.response_tokens) for s in samples],
    }
    names: list[str] = []
    for s in samples:
        names += [k for k in (s.columns or {}) if k not in names and k not in out]
    for name in names:
        out[name] = [(s.columns or {}).get(name) for s in samples]
    return out


def fields_arguments(sample: Any) -> dict[str, Any]:
    """The ``fields`` convention's arguments for one sample."""
    return {"prompt": sample.prompt, "response": sample.response_text, "label": sample.label,
            "metadata": sample.metadata}


def describe(convention: str) -> str:
    """A few words for the start-up banner."""
    return {
        "batched": "batched fn(samples)",
        "verl": "verl compute_score",
        "trl": "TRL fn(prompts, completions, ...)",
        "fields": "fn(prompt, response, label, metadata)",
        "sample": "fn(sample)",
    }[convention]
