"""``reasoning-gym`` tasks as prompt data, scored by each task's own scorer (nothing to download).

A task is named by a URI: ``reasoning-gym:<task>[?size=N&seed=S&<config field>=<value>...]``, e.g.
``reasoning-gym:chain_sum?size=2048&seed=0&max_terms=2&max_digits=1``: ``size`` items (default
:data:`DEFAULT_SIZE`) from the task's generator with ``seed`` (default 0) and the task's own config fields
(``chain_sum``'s ``min_terms``, ``max_digits`` ...; values are read as JSON where they parse, else as text).
It works as ``--prompt-data`` directly (materialised once into the data cache) and as the source of
``raygym data prepare`` (with ``--size`` / ``--seed``).

Rows: ``{"prompt": question, "label": answer, "metadata": {"reasoning_gym": {"task", "entry"}}}``; the entry is
the generator's item (question, answer, metadata) that the task's ``score_answer`` reads. ``rm_type=
"reasoning_gym"`` (the default reward of such data) scores a response with that scorer: the text between the
last ``<answer>`` and ``</answer>`` when the response has them (reasoning-gym's answer format), else the whole
stripped response.

>>> rows = task_rows(parse_task("reasoning-gym:chain_sum?size=2&seed=0&max_terms=2&max_digits=1"))
>>> rows[0]["prompt"], rows[0]["label"]
('State the final answer to the following arithmetic problem: 0 - 4 =', '-4')
>>> reasoning_gym_reward(" -4", "-4", rows[0]["metadata"]), reasoning_gym_reward("<answer>9</answer>", "-4", rows[0]["metadata"])
(1.0, 0.0)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from raygym.errors import ConfigError

PREFIX = "reasoning-gym:"
DEFAULT_SIZE = 1024
METADATA_KEY = "reasoning_gym"
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.S)
_INSTALL = "pip install 'raygym[reasoning-gym]'"


def is_task_uri(uri: str | None) -> bool:
    """True for a ``reasoning-gym:`` URI."""
    return bool(uri) and str(uri).startswith(PREFIX)


@dataclass(frozen=True)
class TaskSpec:
    """One ``reasoning-gym:`` URI, parsed: the task, how many items, the generator seed, the task's config."""

    uri: str
    task: str
    size: int = DEFAULT_SIZE
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_task(uri: str, field_name: str = "prompt_data") -> TaskSpec:
    """Parse ``reasoning-gym:<task>[?size=N&seed=S&key=value...]``; ConfigError naming ``field_name``.

    >>> parse_task("reasoning-gym:letter_counting?size=64&max_words=3")
    TaskSpec(uri='reasoning-gym:letter_counting?size=64&max_words=3', task='letter_counting', size=64, seed=0, config={'max_words': 3})
    """
    body = uri.removeprefix(PREFIX)
    task, _, query = body.partition("?")
    if not re.fullmatch(r"[A-Za-z_][\w]*", task):
        raise ConfigError(f"{field_name}={uri!r}: name a reasoning-gym task after 'reasoning-gym:', e.g. "
                          "'reasoning-gym:chain_sum' (the tasks: python -c \"import reasoning_gym.factory as f; "
                          "print(sorted(f.DATASETS))\")")
    config = {k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))} \
        if query else {}
    size, seed = config.pop("size", DEFAULT_SIZE), config.pop("seed", 0)
    for name, value, low in (("size", size, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"{field_name}={uri!r}: {name}={value!r} must be a whole number >= {low}")
    return TaskSpec(uri, task, size, seed, config)


def _registry() -> Mapping[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"reasoning-gym tasks need the reasoning-gym package: {_INSTALL}") from None
    return DATASETS


def _dataset(spec: TaskSpec, field_name: str) -> Any:
    """The task's generator for ``spec`` (config checked: unknown task, unknown or invalid config field)."""
    registry = _registry()
    if spec.task not in registry:
        import difflib

        close = difflib.get_close_matches(spec.task, list(registry), n=3)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"it has {len(registry)} tasks"
        raise ConfigError(f"{field_name}={spec.uri!r}: reasoning-gym has no task {spec.task!r}; {hint}")
    import dataclasses

    from reasoning_gym import create_dataset

    config_cls = registry[spec.task][1]
    known = {f.name for f in dataclasses.fields(config_cls)} - {"size", "seed"}
    unknown = sorted(set(spec.config) - known)
    if unknown:
        raise ConfigError(f"{field_name}={spec.uri!r}: {spec.task} has no config field "
                          f"{', '.join(map(repr, unknown))}; its fields: {', '.join(sorted(known))}")
    try:
        return create_dataset(spec.task, size=spec.size, seed=spec.seed, **spec.config)
    except (AssertionError, TypeError, ValueError) as exc:
        raise ConfigError(f"{field_name}={spec.uri!r}: {spec.task} refused this config ({exc or type(exc).__name__}); "
                          "fix the config fields in the URI") from None


def check_task(uri: str, field_name: str = "prompt_data") -> TaskSpec:
    """Check a ``reasoning-gym:`` URI before anything starts (the package, the task, its config)."""
    spec = parse_task(uri, field_name)
    _dataset(spec, field_name)
    return spec


def task_rows(spec: TaskSpec, field_name: str = "prompt_data") -> list[dict[str, Any]]:
    """The task's ``size`` items as prompt rows (see the module docstring)."""
    rows = []
    for entry in _dataset(spec, field_name):
        plain = json.loads(json.dumps(entry, default=str))  # what a jsonl round trip gives the scorer anyway
        rows.append({"prompt": str(entry["question"]), "label": str(entry["answer"]),
                     "metadata": {METADATA_KEY: {"task": spec.task, "entry": plain}}})
    return rows


def materialize_task(uri: str, directory: str | os.PathLike[str], field_name: str = "prompt_data") -> str:
    """Write the rows of ``uri`` as jsonl under ``directory`` (once per URI) and return the path."""
    spec = parse_task(uri, field_name)
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    path = Path(directory) / f"reasoning-gym-{spec.task}-{digest}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in task_rows(spec, field_name)))
        os.replace(tmp, path)
    return str(path)


@cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)  # type: ignore[return-value]


def answer_text(response: str) -> str:
    """What is scored: the last ``<answer>...</answer>`` of the response when it has one, else all of it, stripped.

    >>> answer_text("so <answer> 12 </answer>"), answer_text(" 12\\n")
    ('12', '12')
    """
    found = _ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def reasoning_gym_reward(response: str, label: Any, metadata: Mapping[str, Any] | None) -> float:
    """The task's own ``score_answer`` for ``response``, from ``metadata["reasoning_gym"]`` (task and item).
    Raises ValueError for a row without it (counted as a reward error)."""
    info = (metadata or {}).get(METADATA_KEY)
    if not isinstance(info, Mapping) or "task" not in info or "entry" not in info:
        raise ValueError("the row has no metadata['reasoning_gym'] {task, entry}; make the data with "
                         "reasoning-gym:<task> (--prompt-data or raygym data prepare)")
    entry = dict(info["entry"])
    entry.setdefault("answer", label)
    return float(_scorer(str(info["task"]))(answer_text(response), entry))


def check_rows_scorable(url: str, field_name: str = "prompt_data") -> None:
    """``rm_type='reasoning_gym'`` on a data file: its first row must carry ``metadata['reasoning_gym']``."""
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as fh:
        first = next((line for line in fh if line.strip()), "")
    try:
        row = json.loads(first) if first else {}
    except json.JSONDecodeError:
        return  # the data check names a line that is not JSON
    metadata = row.get("metadata") if isinstance(row, dict) else None
    if isinstance(metadata, str):
        metadata = _value(metadata)
    if not isinstance(metadata, dict) or not isinstance(metadata.get(METADATA_KEY), dict):
        raise ConfigError(f"rm_type='reasoning_gym' scores rows made from reasoning-gym tasks, but {field_name}="
                          f"{url!r} has no metadata['reasoning_gym'] in its first row; make the data with "
                          "'raygym data prepare reasoning-gym:<task> ...' or --prompt-data reasoning-gym:<task>, "
                          "or pass another --rm-type")
