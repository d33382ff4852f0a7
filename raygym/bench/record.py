"""The table of record: ``docs/benchmarks.md``'s generated section and chart, from ``docs/bench-records.jsonl``.

Each line of the records file is one measured figure: ``figure`` (the benchmark's name for it), ``label`` (what
tells it from the figure's other rows), ``value``, ``baseline`` (measured in the same run), ``unit``, ``ratio``
and ``ratio_is`` (what the ratio divides), ``command``, ``machine`` and ``date``; ``runs`` where the ratio is one
of several runs'. Lines are in the order they were measured: a later line for the same figure and label replaces
an earlier one in the table, and the file keeps both.

    raygym bench record                        regenerate the section between the markers, and the chart
    raygym bench record --check                exit 1 when docs/benchmarks.md is not what the records give
    raygym bench record --add DIR              append the rows of a ``raygym bench NAME --out DIR`` run that carry
                                               a ratio (its command and date from DIR/run.json), then regenerate

Run from the checkout's root (or ``--docs DIR``). The text outside the markers is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raygym.bench.charts import number, row_context
from raygym.errors import ConfigError

RECORDS = "bench-records.jsonl"
DOC = "benchmarks.md"
CHART = "bench-ratios.png"
BEGIN = "<!-- raygym bench record: generated from docs/bench-records.jsonl; edit that file, then run `raygym " \
        "bench record` -->"
END = "<!-- raygym bench record: end -->"
REQUIRED = ("figure", "label", "command", "machine", "date")


def load_records(text: str) -> list[dict[str, Any]]:
    """The records of a records file's text, checked: each a JSON object with :data:`REQUIRED` fields and a
    numeric or null ``ratio``; ConfigError naming the line otherwise."""
    records = []
    for number_, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{RECORDS} line {number_}: not JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise ConfigError(f"{RECORDS} line {number_}: a JSON object per line, got {line[:60]!r}")
        if missing := [k for k in REQUIRED if not record.get(k)]:
            raise ConfigError(f"{RECORDS} line {number_}: no {', '.join(missing)} (every record names "
                              f"{', '.join(REQUIRED)})")
        if record.get("ratio") is not None and number(record["ratio"]) is None:
            raise ConfigError(f"{RECORDS} line {number_}: ratio={record['ratio']!r}; a number or null")
        records.append(record)
    return records


def latest(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per (figure, label), the last one in the file; newest date first, later lines first."""
    last: dict[tuple[str, str], tuple[int, Mapping[str, Any]]] = {}
    for index, record in enumerate(records):
        last[(record["figure"], record["label"])] = (index, record)
    return [r for _, r in sorted(last.values(), key=lambda item: (str(item[1]["date"]), item[0]), reverse=True)]


def _figure_text(value: Any, unit: str = "") -> str:
    x = number(value)
    if x is None:
        return "-" if value is None else str(value)
    return f"{x:g}{(' ' + unit) if unit else ''}"


def render_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The generated section: a table of the latest records (commands numbered under it) and the chart."""
    shown = latest(records)
    commands: list[str] = []
    for record in shown:
        if record["command"] not in commands:
            commands.append(record["command"])
    lines = ["![every ratio of the table against 1.0](bench-ratios.png)", "",
             "| date | figure | what | value | baseline | ratio | ratio is | machine | command |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in shown:
        unit = str(r.get("unit") or "")
        ratio = _figure_text(r.get("ratio"))
        if r.get("ratio") is not None:
            ratio = f"**{ratio}**"
        if runs := r.get("runs"):
            ratio += " (runs: " + ", ".join(_figure_text(x) for x in runs) + ")"
        cells = [str(r["date"]), f"`{r['figure']}`", str(r["label"]), _figure_text(r.get("value"), unit),
                 _figure_text(r.get("baseline"), unit), ratio, str(r.get("ratio_is") or ""), str(r["machine"]),
                 f"({commands.index(r['command']) + 1})"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "Commands:", ""]
    lines += [f"{i}. `{command}`" for i, command in enumerate(commands, 1)]
    return "\n".join(lines)


def render_doc(doc: str, records: Sequence[Mapping[str, Any]]) -> str:
    """``doc`` with the text between :data:`BEGIN` and :data:`END` replaced by :func:`render_table`; ConfigError
    when the markers are missing."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        raise ConfigError(f"docs/{DOC} has no generated section: put the lines\n{BEGIN}\n{END}\nwhere the "
                          "table of record goes")
    return doc[: start + len(BEGIN)] + "\n" + render_table(records) + "\n" + doc[end:]


def machine_text(machine: object) -> str:
    """A row's ``machine`` in a few words: cores and device.

    >>> machine_text({"cores": 2, "device": "cpu", "torch": "2.13"})
    '2 cores, cpu'
    """
    if not isinstance(machine, Mapping):
        return str(machine or "unknown")
    cores = machine.get("cores", machine.get("cpus"))
    device = machine.get("gpu") or machine.get("device") or "cpu"
    return f"{cores} cores, {device}" if cores else str(device)


def records_from_run(rows: Sequence[Mapping[str, Any]], run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records of a ``raygym bench NAME --out DIR`` run: one per row with a numeric ratio."""
    records = []
    for row in rows:
        if number(row.get("ratio")) is None:
            continue
        baseline = row.get("baseline_value", row.get("baseline"))
        records.append({"figure": str(row.get("figure") or run["benchmark"]),
                        "label": row_context(row) or str(run["benchmark"]),
                        "value": number(row.get("value")), "baseline": number(baseline),
                        "unit": str(row.get("unit") or ""), "ratio": number(row["ratio"]),
                        "ratio_is": str(row.get("ratio_is") or ""), "command": str(run["command"]),
                        "machine": machine_text(row.get("machine")), "date": str(run["started"])[:10]})
    return records


def write_chart(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """The table's ratios against 1.0, as a PNG at ``path``."""
    from raygym.bench.charts import ratio_chart

    points = [(f"{r['figure']}: {r['label']}", float(r["ratio"])) for r in latest(records) if r.get("ratio")]
    path.write_bytes(ratio_chart(points, "the table of record: each ratio against its same-run baseline"))


def main(argv: Sequence[str] | None = None) -> int:
    """``raygym bench record``; returns the exit status."""
    p = argparse.ArgumentParser(prog="raygym bench record", description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default="docs", help="the folder of benchmarks.md and bench-records.jsonl")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when the doc is out of date")
    p.add_argument("--add", metavar="DIR", help="a `raygym bench NAME --out DIR` folder to add to the records")
    args = p.parse_args(argv)
    docs = Path(args.docs)
    doc_path, records_path = docs / DOC, docs / RECORDS
    if not doc_path.is_file() or not records_path.is_file():
        raise ConfigError(f"--docs {docs}: no {DOC} and {RECORDS} there; run from the checkout's root or pass "
                          "--docs DIR")
    records = load_records(records_path.read_text())
    if args.add:
        run_dir = Path(args.add)
        if not (run_dir / "run.json").is_file():
            raise ConfigError(f"--add {run_dir}: no run.json there (write one with raygym bench NAME --out DIR)")
        rows = load_rows((run_dir / "results.jsonl").read_text())
        added = records_from_run(rows, json.loads((run_dir / "run.json").read_text()))
        with records_path.open("a") as out:
            out.writelines(json.dumps(r) + "\n" for r in added)
        records += added
        print(f"raygym bench record: added {len(added)} record(s) from {run_dir}", file=sys.stderr)
    text = doc_path.read_text()
    wanted = render_doc(text, records)
    if args.check:
        if wanted != text:
            print(f"raygym bench record: {doc_path} is not what {records_path} gives; run raygym bench record",
                  file=sys.stderr)
            return 1
        return 0
    doc_path.write_text(wanted)
    write_chart(records, docs / CHART)
    print(f"raygym bench record: wrote {doc_path} ({len(latest(records))} figures) and {docs / CHART}",
          file=sys.stderr)
    return 0


def load_rows(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a ``results.jsonl``."""
    return [row for line in text.splitlines() if line.strip() and isinstance(row := json.loads(line), dict)]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"raygym bench record: error: {exc}", file=sys.stderr)
        sys.exit(2)
