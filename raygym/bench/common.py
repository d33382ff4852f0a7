"""What several benchmarks need beside their measurements: a raygym for another interpreter, and a server's health."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
