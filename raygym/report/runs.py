"""Reading run directories for the report (pure: files through fsspec, no torch, no ray).

A run directory holds ``config.json``, ``metrics.jsonl``, ``traces/step_*.jsonl`` (``capture_trace``) and
``eval/<checkpoint>/{metrics.json,samples.jsonl}`` (``raygym eval``). Every part is optional, so a run
that is still starting, or a directory with only some of them, still reports what it has.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_TRACES_PER_RUN = 2000  # sampled records embedded per run (the page stays small)
TEXT_LIMIT = 2000  # characters kept of a prompt or a response


@dataclass
class RunData:
    """What the report shows of one run."""

    name: str
    path: str
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl, one dict per step
    traces: list[dict[str, Any]] = field(default_factory=list)  # browser records (see trace_entry)
    evals: list[dict[str, Any]] = field(default_factory=list)  # raygym eval metrics.json files


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _read_text(url: str) -> str | None:
    fs, path = _fs(url)
    try:
        with fs.open(path, "r") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def read_jsonl(text: str | None) -> list[dict[str, Any]]:
    """Objects of a JSON-lines text; a line cut by a crash (or being written) is skipped.

    >>> read_jsonl('{"step": 0}\\n{"step": 1}\\n{"ste')
    [{'step': 0}, {'step': 1}]
    """
    rows: list[dict[str, Any]] = []
    for line in (text or "").splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            rows.append(value)
    return rows


def clean_number(value: Any) -> Any:
    """Numbers as JSON can carry them: NaN/inf (and their string forms in metrics.jsonl) become None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if value in ("inf", "-inf", "nan"):
        return None
    return value


def _clip(text: Any) -> str:
    if text is None:
        return ""
    text = text if isinstance(text, str) else json.dumps(text, default=str)
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + " …"


def trace_entry(source: str, step: Any, record: dict[str, Any]) -> dict[str, Any]:
    """One row of the trace browser from a training trace or an eval sample record."""
    return {
        "source": source,
        "step": step,
        "prompt": _clip(record.get("prompt")),
        "response": _clip(record.get("response_text", record.get("response"))),
        "reward": clean_number(record.get("reward")),
        "label": _clip(record.get("label")),
        "finish": record.get("finish_reason") or "",
        "tokens": record.get("response_tokens"),
        "where": record.get("engine_name") or record.get("dataset") or "",
    }


def _list(url: str) -> list[str]:
    fs, path = _fs(url)
    if not fs.isdir(path):
        return []
    return sorted(fs.ls(path, detail=False))


def load_run(path: str, name: str | None = None, max_traces: int = MAX_TRACES_PER_RUN) -> RunData:
    """Read one run directory (local path or fsspec URL)."""
    config = {}
    text = _read_text(_join(path, "config.json"))
    if text:
        try:
            loaded = json.loads(text)
            config = loaded if isinstance(loaded, dict) else {}
        except json.JSONDecodeError:
            config = {}
    rows = [{k: clean_number(v) for k, v in r.items()} for r in read_jsonl(_read_text(_join(path, "metrics.jsonl")))]
    run = RunData(name or str(config.get("run_id") or path.rstrip("/").rsplit("/", 1)[-1]), path, config, rows)
    for trace_file in _list(_join(path, "traces")):
        for record in read_jsonl(_read_text(trace_file)):
            if len(run.traces) >= max_traces:
                break
            run.traces.append(trace_entry("train", record.get("step"), record))
    for eval_dir in _list(_join(path, "eval")):
        metrics_text = _read_text(_join(eval_dir, "metrics.json"))
        if not metrics_text:
            continue
        try:
            summary = json.loads(metrics_text)
        except json.JSONDecodeError:
            continue
        label = eval_dir.rstrip("/").rsplit("/", 1)[-1]
        run.evals.append({"name": label, "step": summary.get("step"),
                          "metrics": {k: clean_number(v) for k, v in (summary.get("metrics") or {}).items()}})
        for record in read_jsonl(_read_text(_join(eval_dir, "samples.jsonl"))):
            if len(run.traces) >= max_traces:
                break
            run.traces.append(trace_entry(f"eval {label}", summary.get("step"), record))
    return run


def unique_names(paths: list[str]) -> list[str]:
    """Display names for run paths: the last path part, made unique with a counter.

    >>> unique_names(["a/run", "b/run", "c/other"])
    ['run', 'run (2)', 'other']
    """
    names: list[str] = []
    for path in paths:
        base = path.rstrip("/").rsplit("/", 1)[-1] or path
        name, k = base, 2
        while name in names:
            name, k = f"{base} ({k})", k + 1
        names.append(name)
    return names


__all__ = ["RunData", "clean_number", "load_run", "read_jsonl", "trace_entry", "unique_names"]
