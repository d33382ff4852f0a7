"""``raygym train --rollout-engine sglang`` on the tiny preset learns with stock SGLang as its engine (CPU
backend, its own interpreter), every weight sync verified by the probe; the default engine is unchanged."""

from __future__ import annotations

import pytest

from tests.engine_training import assert_learns_with_probe_verified_syncs, train_with_engine

pytestmark = [pytest.mark.sglang_cpu, pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 40


def test_train_with_stock_sglang_learns(tmp_path, sglang_python):
    rows, log = train_with_engine(["--rollout-engine", "sglang", "--rollout-engine-python", sglang_python,
                                   "--num-rollout", str(STEPS)], tmp_path / "run")
    assert_learns_with_probe_verified_syncs(rows, STEPS)
    assert "sglang" in log.lower() and "RAYGYM_ENGINE_API_KEY" not in log
