"""Build, write and watch the report file."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from raygym.errors import ConfigError
from raygym.report.content import CHARTS, chart_series, config_differences, recipe_defaults, run_summary
from raygym.report.page import render_page
from raygym.report.runs import RunData, load_run, unique_names

DEFAULT_WATCH_INTERVAL_S = 10.0


def load_runs(paths: Sequence[str]) -> list[RunData]:
    """Every run directory, named by its run id (or directory name), names made unique."""
    if not paths:
        raise ConfigError("report: no run directory given; pass one or more, e.g. raygym report runs/a runs/b")
    runs = []
    for path in paths:
        run = load_run(path)
        if not run.config and not run.rows:
            raise ConfigError(f"report: {path!r} has neither config.json nor metrics.jsonl; is it a run directory?")
        runs.append(run)
    for run, name in zip(runs, unique_names([r.name for r in runs]), strict=True):
        run.name = name
    return runs


def report_data(runs: Sequence[RunData]) -> dict[str, Any]:
    """The page data: runs, config differences, chart series and trace records."""
    single = len(runs) == 1
    return {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "runs": [run_summary(r) for r in runs],
        "config": {"single": single, "rows": config_differences(runs, recipe_defaults() if single else None)},
        "charts": [{"id": c.id, "title": c.title, "unit": c.unit, "series": chart_series(runs, c)} for c in CHARTS],
        "traces": [{"run": i, **t} for i, r in enumerate(runs) for t in r.traces],
    }


def build_report(paths: Sequence[str], *, refresh_s: float | None = None, title: str | None = None) -> str:
    """The report HTML for the run directories ``paths``."""
    runs = load_runs(paths)
    title = title or ("raygym report: " + ", ".join(r.name for r in runs))
    return render_page(report_data(runs), title, refresh_s)


def write_report(paths: Sequence[str], out: str, *, refresh_s: float | None = None) -> str:
    """Write the report to ``out`` atomically (a browser reloading it never sees half a file)."""
    text = build_report(paths, refresh_s=refresh_s)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, target)
    return str(target)


def watch_report(paths: Sequence[str], out: str, *, interval_s: float = DEFAULT_WATCH_INTERVAL_S,
                 stop: threading.Event | None = None, on_write: Callable[[str], None] | None = None) -> None:
    """Rewrite the report every ``interval_s`` seconds until ``stop`` is set (or Ctrl-C); the page
    reloads itself at the same interval. ``on_write(path)`` is called after each write."""
    if not interval_s > 0:
        raise ConfigError(f"interval={interval_s!r}: must be > 0 seconds")
    stop = stop or threading.Event()
    while True:
        path = write_report(paths, out, refresh_s=interval_s)
        if on_write is not None:
            on_write(path)
        if stop.wait(interval_s):
            return


__all__ = ["build_report", "load_runs", "report_data", "watch_report", "write_report"]
