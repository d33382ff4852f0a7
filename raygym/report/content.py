"""What the report shows, computed from :class:`~raygym.report.runs.RunData` (pure): the curves of each
chart, the config differences and the per-run summary."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raygym.report.runs import RunData


@dataclass(frozen=True)
class Chart:
    """One chart: the metric keys it draws (``fnmatch`` patterns over metrics.jsonl keys)."""

    id: str
    title: str
    patterns: tuple[str, ...]
    unit: str = ""  # "bytes" | "s" | "" (axis formatting)


CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Rollout reward (mean)", ("rollout/reward_mean",)),
    Chart("eval-reward", "Eval reward (mean)", ("eval/*/reward_mean",)),
    Chart("eval-pass", "Eval pass@k", ("eval/*/pass@*",)),
    Chart("kl", "KL", ("train/approx_kl", "train/kl_loss", "train/kl")),
    Chart("entropy", "Entropy", ("train/entropy",)),
    Chart("clipfrac", "Clip fraction", ("train/clipfrac", "critic/value_clipfrac")),
    Chart("grad-norm", "Grad norm", ("train/grad_norm", "critic/grad_norm")),
    Chart("response-len", "Response length (tokens)", ("rollout/response_len_mean", "rollout/response_len_max")),
    Chart("phases", "Phase timings (s per step)", ("perf/*_time",), "s"),
    Chart("sync-bytes", "Weight sync bytes per step", ("sync/bytes", "sync/raw_bytes"), "bytes"),
    Chart("sync-seconds", "Weight sync seconds per step", ("sync/total_s", "sync/transfer_s", "sync/encode_s",
                                                           "sync/time_s"), "s"),
)


def matching_keys(rows: Sequence[dict[str, Any]], patterns: Sequence[str]) -> list[str]:
    """Numeric keys of ``rows`` matching any pattern, in pattern order then by name.

    >>> matching_keys([{"perf/step_time": 1.0, "perf/sync_time": 0.1, "x": 2}], ["perf/*_time"])
    ['perf/step_time', 'perf/sync_time']
    """
    present = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out: list[str] = []
    for pattern in patterns:
        out += sorted(k for k in present if fnmatch.fnmatchcase(k, pattern) and k not in out)
    return out


def chart_series(runs: Sequence[RunData], chart: Chart) -> list[dict[str, Any]]:
    """``[{"run": i, "key": k, "points": [[step, value], ...]}]`` for every run and matching key."""
    series: list[dict[str, Any]] = []
    for index, run in enumerate(runs):
        for key in matching_keys(run.rows, chart.patterns):
            points = [[r["step"], r[key]] for r in run.rows
                      if isinstance(r.get("step"), (int, float)) and isinstance(r.get(key), (int, float))]
            if points:
                series.append({"run": index, "key": key, "points": points})
    return series


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; other values kept as they are.

    >>> flatten({"recipe": {"lr": 1e-6}, "run_id": "a"})
    {'recipe.lr': 1e-06, 'run_id': 'a'}
    """
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


IGNORED_CONFIG_KEYS = ("run_id", "output_dir")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def config_differences(runs: Sequence[RunData], defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows ``{"field", "values": [text per run]}`` of the config fields that differ between the runs.

    With one run (or ``defaults`` given), fields whose value differs from ``defaults`` (a flat dict of
    ``recipe.<field>`` values) are listed too, so a single run shows what it changed. Paths that only
    name the run (``run_id``, ``output_dir``) are left out.
    """
    flat = [flatten(r.config) for r in runs]
    defaults = defaults or {}
    keys = sorted({k for f in flat for k in f if k not in IGNORED_CONFIG_KEYS})
    rows = []
    for key in keys:
        values = [_text(f.get(key, "—")) for f in flat]
        default = _text(defaults[key]) if key in defaults else None
        if len(set(values)) > 1 or (len(runs) == 1 and default is not None and default != values[0]):
            rows.append({"field": key, "values": values, "default": default})
    return rows


def recipe_defaults() -> dict[str, Any]:
    """The ``Recipe()`` defaults as ``recipe.<field>`` keys (JSON-safe)."""
    from raygym.config import Recipe

    values = json.loads(json.dumps(Recipe().field_values(), default=str))
    return {f"recipe.{k}": v for k, v in values.items()}


def _last(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def run_summary(run: RunData) -> dict[str, Any]:
    """One line of the runs table: steps, first/last reward, last eval reward, total time."""
    rewards = [r["rollout/reward_mean"] for r in run.rows if isinstance(r.get("rollout/reward_mean"), (int, float))]
    eval_keys = matching_keys(run.rows, ("eval/*/reward_mean",))
    planned = (run.config.get("recipe") or {}).get("num_rollout") if isinstance(run.config.get("recipe"), dict) else None
    return {
        "name": run.name,
        "path": run.path,
        "model": (run.config.get("model") or {}).get("hf_checkpoint", "") if isinstance(run.config.get("model"), dict) else "",
        "steps": len(run.rows),
        "planned_steps": planned,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "eval_last": {k.split("/")[1]: _last(run.rows, k) for k in eval_keys},
        "time_s": sum(r["perf/step_time"] for r in run.rows if isinstance(r.get("perf/step_time"), (int, float))),
        "traces": len(run.traces),
    }


__all__ = ["CHARTS", "Chart", "chart_series", "config_differences", "flatten", "matching_keys", "recipe_defaults",
           "run_summary"]
