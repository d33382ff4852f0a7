"""What several benchmarks need beside their measurements: a raygym for another interpreter, and a server's health."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import raygym


@contextlib.contextmanager
def raygym_on_path() -> Iterator[str]:
    """A directory holding only this raygym package (a link to it), for ``PYTHONPATH`` of another interpreter
    (TRL's): that interpreter then imports the raygym this one runs, installed or a checkout, and nothing else
    from this interpreter's packages. Removed on exit."""
    with tempfile.TemporaryDirectory(prefix="raygym-on-path-") as folder:
        os.symlink(Path(raygym.__file__).resolve().parent, Path(folder) / "raygym")
        yield folder


def wait_healthy(proc: subprocess.Popen[bytes] | subprocess.Popen[str], url: str, timeout_s: float) -> None:
    """Until the engine server at ``url`` (started as ``proc``) answers ``/health_generate``; raises
    ``EngineConnectionError`` when the process exits first or ``timeout_s`` passes."""
    from raygym.engine_api.client import EngineClient

    async def wait() -> None:
        async with EngineClient(url) as client:
            await client.wait_healthy(lambda: proc.poll() is None, timeout_s)

    asyncio.run(wait())


def figure_row(figure: str, value: float, machine: dict[str, Any], unit: str = "s", baseline: float | None = None,
               ratio: float | None = None, ratio_is: str | None = None, goal: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """One benchmark result as the JSON object a benchmark prints: the figure, its value, its same-run baseline and
    ratio, extra fields (floats rounded) and the machine.

    >>> figure_row("f", 1.23456789, {"cores": 2}, baseline=2.0, ratio=0.6172839, ratio_is="f / b")["ratio"]
    0.6173
    """
    row: dict[str, Any] = {"figure": figure, "value": round(value, 6), "unit": unit}
    if baseline is not None:
        row["baseline"] = round(baseline, 6)
    if ratio is not None:
        row.update(ratio=round(ratio, 4), ratio_is=ratio_is)
    if goal:
        row["goal"] = goal
    row.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items()})
    row["machine"] = machine
    return row
