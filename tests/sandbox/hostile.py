"""Helpers of the sandbox tests: the backends that work here and hostile candidates."""

from __future__ import annotations

import os

from raygym.sandbox import Limits, SandboxUnavailable, detect_backend

FAST = Limits(cpu_seconds=2, wall_seconds=4.0, memory_bytes=256 * 1024 * 1024, processes=16)
MiB = 1024 * 1024


def working_backends() -> list[str]:
    """The isolating backends that work on this machine, each of which the tests force by name (so the
    ``unshare`` fallback runs on a machine that has bubblewrap too)."""
    found = []
    for backend in ("bwrap", "unshare"):
        try:
            detect_backend(backend, os.geteuid() == 0)
            found.append(backend)
        except SandboxUnavailable as exc:
            print(f"sandbox backend {backend} does not work here: {exc}")
    return found


def hostile(attack: str) -> str:
    """A candidate whose ``f`` is right only when ``attack`` (code that sets ``worked``) succeeded, so a
    score of 0 means the attack failed."""
    return f"worked = False\n{attack}\ndef f(x):\n    return x + 1 if worked else -1\n"
