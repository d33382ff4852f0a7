"""``raygym train --rollout-engine sglang`` on the tiny preset learns with stock SGLang as its engine (CPU
backend, its own interpreter), every weight sync verified by the probe; raygym is installed from its wheel into
a fresh venv made from the same base Python as SGLang's (as users install it), so SGLang must import its own
packages, never the trainer's."""

from __future__ import annotations

import pytest

from tests.engine_training import (
    assert_learns_with_probe_verified_syncs,
    installed_raygym_python,
    train_with_engine,
)

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 40


def test_train_with_stock_sglang_learns(tmp_path, sglang_python):
    python = installed_raygym_python(tmp_path / "wheel")
    rows, log = train_with_engine(["--rollout-engine", "sglang", "--rollout-engine-python", sglang_python,
                                   "--num-rollout", str(STEPS)], tmp_path / "run", python=python)
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    assert "sglang" in log.lower() and "RAYGYM_ENGINE_API_KEY" not in log
