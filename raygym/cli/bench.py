"""``raygym bench``: the benchmarks shipped in the package (:mod:`raygym.bench`); see :data:`USAGE`.

A benchmark's JSON lines go to stdout as it prints them; what is running and for how long goes to stderr. With
``--out DIR`` the rows are also written to ``DIR/results.jsonl``, the run (command, seconds, exit status) to
``DIR/run.json`` and a one-file HTML report with charts to ``DIR/report.html``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from raygym.bench import benchmark_names, summary
from raygym.errors import ConfigError

USAGE = """usage:
  raygym bench --list
  raygym bench NAME [ARGS...] [--out DIR]   python -m raygym.bench.NAME ARGS with this interpreter; --out DIR also
                                            writes DIR/results.jsonl, DIR/run.json and DIR/report.html (charts)
  raygym bench NAME --help                  the benchmark's own flags
  raygym bench record [--check]             regenerate docs/benchmarks.md from docs/bench-records.jsonl"""
HEARTBEAT_S = 30.0  # how often a run that prints nothing says it is still running
RECORD = "record"


def _say(message: str) -> None:
    click.echo(f"raygym bench: {message}", err=True)


def listing() -> list[str]:
    """``raygym bench --list``: one line per benchmark, then the record tool."""
    names = benchmark_names()
    width = max(len(n) for n in [*names, RECORD])
    lines = [f"{name:<{width}}  {summary(name)}" for name in names]
    lines.append(f"{RECORD:<{width}}  (not a benchmark) regenerate docs/benchmarks.md's table of record and chart "
                 "from docs/bench-records.jsonl")
    return lines


def check_name(name: str) -> str:
    """``name`` if it is a benchmark; ConfigError listing the benchmarks otherwise."""
    names = benchmark_names()
    if name not in names:
        raise ConfigError(f"bench {name!r}: no such benchmark; the benchmarks are {', '.join(names)} "
                          "(raygym bench --list says what each measures)")
    return name


def parse_row(line: str) -> dict[str, Any] | None:
    """The JSON object on a benchmark's output line, or None for any other line.

    >>> parse_row('{"figure": "f", "ratio": 1.5}'), parse_row("# skipped"), parse_row("[1]")
    ({'figure': 'f', 'ratio': 1.5}, None, None)
    """
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def run_benchmark(name: str, args: Sequence[str]) -> tuple[int, list[dict[str, Any]], float]:
    """Run ``python -m raygym.bench.NAME ARGS`` with this interpreter: its stdout lines echoed to stdout as they
    come, its stderr left to the terminal, progress on stderr. Returns (exit status, the JSON rows, seconds)."""
    command = [sys.executable, "-m", f"raygym.bench.{name}", *args]
    _say(f"running {name}: {' '.join(command[1:])}")
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(HEARTBEAT_S):
            _say(f"{name} still running, {time.monotonic() - start:.0f} s, {len(rows)} result(s) so far")

    threading.Thread(target=heartbeat, name="raygym-bench-heartbeat", daemon=True).start()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            click.echo(line, nl=False)
            if (row := parse_row(line)) is not None:
                rows.append(row)
                _say(f"{name}: {row.get('figure') or 'a result'} after {time.monotonic() - start:.1f} s")
        code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        code = 130  # as a shell reports a run stopped by Ctrl-C
    finally:
        finished.set()
    seconds = time.monotonic() - start
    _say(f"{name} {'finished' if code == 0 else f'exited with status {code}'} after {seconds:.1f} s, "
         f"{len(rows)} result(s)")
    return code, rows, seconds


def write_outputs(out: Path, name: str, args: Sequence[str], code: int, rows: Sequence[dict[str, Any]],
                  seconds: float, started: str) -> None:
    """``results.jsonl`` (the rows), ``run.json`` (what ran) and ``report.html`` (charts and table) under ``out``."""
    from raygym.bench.charts import report_html

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = " ".join(["raygym", "bench", name, *args])
    run = {"benchmark": name, "command": command, "started": started, "seconds": round(seconds, 1), "exit": code}
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    facts = {"command": command, "started": started, "seconds": f"{seconds:.1f}", "exit status": str(code)}
    (out / "report.html").write_text(report_html(rows, f"raygym bench {name}", facts))
    _say(f"wrote {out / 'results.jsonl'}, {out / 'run.json'} and {out / 'report.html'}")


@click.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.argument("name", required=False)
@click.option("--list", "show_list", is_flag=True, help="List the benchmarks, one line each.")
@click.option("--out", "out_dir", default=None, metavar="DIR",
              help="Also write DIR/results.jsonl, DIR/run.json and DIR/report.html (charts).")
@click.pass_context
def bench_command(ctx: click.Context, name: str | None, show_list: bool, out_dir: str | None) -> None:
    """Run a benchmark shipped in the package (python -m raygym.bench.NAME ARGS); --list names them."""
    args = list(ctx.args)
    if show_list:
        for line in listing():
            click.echo(line)
        return
    if name in (None, "-h", "--help"):
        click.echo(USAGE)
        click.echo("\nbenchmarks:")
        for line in listing():
            click.echo(f"  {line}")
        return
    assert name is not None
    if name == RECORD:
        from raygym.bench.record import main as record_main

        ctx.exit(record_main(args))
    check_name(name)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    code, rows, seconds = run_benchmark(name, args)
    if out_dir is not None:
        write_outputs(Path(out_dir), name, args, code, rows, seconds, started)
    ctx.exit(code)
