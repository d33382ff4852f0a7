"""Charts and the one-file HTML report of a benchmark's rows (the JSON objects it printed). Pure: rows in, PNG bytes
or HTML text out, nothing read or written.

- ratios: one horizontal bar per row that carries a numeric ``ratio``, against a line at 1.0 (the baseline
  measured in the same run); a log scale when the ratios span more than 20x;
- phases: one stacked bar per row that carries two or more phase times (``rollout_s``, ``train_s``, ... or
  ``rollout_time``, ``train_time``, ...), so a step's time is seen split by phase.

The PNGs are drawn with matplotlib's object API (``Figure`` on an Agg canvas: no pyplot, no global backend) and
embedded in the HTML as base64, so ``report.html`` is one self-contained file.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
PHASES = ("rollout", "generate", "log_probs", "reward", "train", "sync", "eval", "other")
# the fields that tell one row of a figure from another, in the order a label names them
CONTEXT = ("engine", "frontend", "backend", "model", "task", "mode", "world", "dtype", "placement")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def number(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None.

    >>> number(2), number(True), number("3"), number(float("nan"))
    (2.0, None, None, None)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def row_context(row: Row) -> str:
    """What tells this row from its figure's others: engine, model, task, ... from the row or its ``setup``, and a
    baseline given by name.

    >>> row_context({"figure": "raygym_vs_trl_step_s", "setup": {"model": "ref", "task": "builtin:next-digit"}})
    'ref, builtin:next-digit'
    >>> row_context({"figure": "train_tokens_per_s", "baseline": "fixed micro_batch_size=8", "ratio": 1.06})
    'vs fixed micro_batch_size=8'
    """
    setup = row.get("setup")
    where = {**(setup if isinstance(setup, Mapping) else {}), **row}
    parts = [str(where[key]) for key in CONTEXT if isinstance(where.get(key), (str, int)) and where.get(key) != ""]
    if isinstance(row.get("baseline"), str):
        parts.append(f"vs {row['baseline']}")
    return ", ".join(parts)


def row_label(row: Row) -> str:
    """The figure's name, then :func:`row_context` in parentheses when there is one."""
    name = str(row.get("figure") or row.get("engine") or "row")
    context = row_context(row)
    return f"{name} ({context})" if context else name


def ratio_points(rows: Sequence[Row]) -> list[tuple[str, float]]:
    """(label, ratio) of every row with a numeric ``ratio``, in order."""
    return [(row_label(r), ratio) for r in rows if (ratio := number(r.get("ratio"))) is not None]


def phase_bars(rows: Sequence[Row]) -> list[tuple[str, dict[str, float]]]:
    """(label, {phase: seconds}) of every row that carries two or more phase times, in order."""
    bars = []
    for row in rows:
        phases: dict[str, float] = {}
        for phase in PHASES:
            for key in (f"{phase}_s", f"{phase}_time"):
                if (seconds := number(row.get(key))) is not None:
                    phases[phase] = seconds
                    break
        if len(phases) >= 2:
            bars.append((row_label(row), phases))
    return bars


def _png(figure: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    return out.getvalue()


def _figure(bars: int) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(9.0, 1.2 + 0.38 * max(1, bars)))


def ratio_chart(points: Sequence[tuple[str, float]], title: str = "ratio to the same-run baseline") -> bytes:
    """A PNG: one horizontal bar per (label, ratio), the line at 1.0 marking the baseline; a log scale when the
    ratios span more than 20x (or one is not positive: those are left out)."""
    shown = [(label, ratio) for label, ratio in points if ratio > 0]
    figure = _figure(len(shown))
    axes = figure.add_subplot()
    labels = [label for label, _ in shown][::-1]
    values = [ratio for _, ratio in shown][::-1]
    # each bar runs from the baseline (1.0) to the ratio: right of the line above the baseline, left of it below
    axes.barh(range(len(values)), [v - 1.0 for v in values], left=1.0, height=0.6,
              color=[COLORS[0] if v >= 1.0 else COLORS[1] for v in values])
    axes.set_yticks(range(len(values)), labels, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=1)
    if values and max(values) / min(values) > 20:
        axes.set_xscale("log")
    if values:
        axes.set_xlim(min(1.0, *values) / 1.15 if axes.get_xscale() == "log" else 0.0, max(1.0, *values) * 1.15)
    for y, value in enumerate(values):  # the number right of the bar's outer end, or of the line for bars left of it
        axes.annotate(f"{value:.3g}", (max(value, 1.0), y), xytext=(3, 0), textcoords="offset points", va="center",
                      fontsize=8)
    axes.set_xlabel("ratio (1.0 = the baseline)")
    axes.set_title(title, fontsize=10)
    return _png(figure)


def phase_chart(bars: Sequence[tuple[str, Mapping[str, float]]], title: str = "time by phase") -> bytes:
    """A PNG: one stacked horizontal bar per (label, {phase: seconds}), the phases in :data:`PHASES` order."""
    figure = _figure(len(bars))
    axes = figure.add_subplot()
    shown = [phase for phase in PHASES if any(phase in phases for _, phases in bars)]
    left = [0.0] * len(bars)
    for phase, color in zip(shown, COLORS, strict=False):
        widths = [phases.get(phase, 0.0) for _, phases in bars][::-1]
        axes.barh(range(len(bars)), widths, left=left, color=color, height=0.6, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_yticks(range(len(bars)), [label for label, _ in bars][::-1], fontsize=8)
    axes.set_xlabel("seconds")
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(figure)


def png_tag(png: bytes, alt: str) -> str:
    """An ``<img>`` carrying ``png`` inline (base64)."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _cell(value: object) -> str:
    if (x := number(value)) is not None:
        return f"{x:.4g}"
    return "" if value is None else html.escape(str(value))


def report_html(rows: Sequence[Row], title: str, facts: Mapping[str, str] | None = None) -> str:
    """The report of one benchmark run as one self-contained HTML page: ``facts`` (command, exit, seconds), the
    machine of the first row, the charts (ratios; phases where rows carry them), a table of every row's figure,
    value, baseline and ratio, and the rows themselves."""
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}"
             "pre{font-size:12px;white-space:pre-wrap}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    machine = next((r["machine"] for r in rows if isinstance(r.get("machine"), Mapping)), None)
    facts = {**(facts or {}), **({"machine": ", ".join(f"{k}={v}" for k, v in machine.items())} if machine else {})}
    parts.append("<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                                      for k, v in facts.items()) + "</table>")
    if points := ratio_points(rows):
        parts += ["<h2>Ratios</h2>", png_tag(ratio_chart(points), "ratio of each figure to its baseline")]
    if bars := phase_bars(rows):
        parts += ["<h2>Time by phase</h2>", png_tag(phase_chart(bars), "time of each row split by phase")]
    if not rows:
        parts.append("<p>The benchmark printed no result.</p>")
    else:
        parts.append("<h2>Figures</h2><table><tr><th>figure</th><th>value</th><th>unit</th><th>baseline</th>"
                     "<th>ratio</th><th>ratio is</th></tr>")
        parts += [f"<tr><td>{html.escape(row_label(r))}</td><td>{_cell(r.get('value'))}</td>"
                  f"<td>{_cell(r.get('unit'))}</td><td>{_cell(r.get('baseline_value', r.get('baseline')))}</td>"
                  f"<td>{_cell(r.get('ratio'))}</td><td>{_cell(r.get('ratio_is'))}</td></tr>" for r in rows]
        parts.append("</table>")
        text = "\n".join(json.dumps(r, sort_keys=True) for r in rows)
        parts.append(f"<h2>Rows</h2><details><summary>{len(rows)} JSON rows</summary><pre>{html.escape(text)}"
                     "</pre></details>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
