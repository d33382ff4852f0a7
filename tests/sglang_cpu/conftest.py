"""Stock SGLang (its CPU backend) in its own interpreter, installed by scripts/install_sglang_cpu.sh.

The interpreter comes from ``RAYGYM_SGLANG_PYTHON`` (``.ci/run`` sets it) or the script's default place,
``.venvs/sglang-cpu/venv/bin/python``. Without either the tests are skipped with that reason (printed by
``-ra``); ``.ci/run`` installs SGLang and runs them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venvs" / "sglang-cpu"


def sglang_home() -> Path:
    python = os.environ.get("RAYGYM_SGLANG_PYTHON")
    return Path(os.path.abspath(python)).parents[2] if python else DEFAULT_VENV  # <home>/venv/bin/python


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The interpreter that runs stock SGLang (skips with the reason when there is none)."""
    python = os.environ.get("RAYGYM_SGLANG_PYTHON") or str(DEFAULT_VENV / "venv" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"no SGLang interpreter at {python}: run scripts/install_sglang_cpu.sh (or set "
                    "RAYGYM_SGLANG_PYTHON); .ci/run does")
    probe = subprocess.run([python, "-c", "import sgl_kernel, sglang"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.fail(f"{python} cannot import SGLang's CPU backend:\n{probe.stderr[-2000:]}")
    return python


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> str:
    """The builtin tiny Qwen3 (random weights, character tokenizer) as a HF directory SGLang loads."""
    from raygym.builtin import TINY_MODEL, materialize_model

    return materialize_model(TINY_MODEL, tmp_path_factory.mktemp("sglang-model"), seed=0)
