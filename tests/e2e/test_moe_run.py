"""``raygym train --hf-checkpoint builtin:tiny-qwen3-moe`` (8 experts, top-2) learns on raygym's server, as a user
runs it, with and without routing replay (``--use-rollout-routing-replay``): every sync verified tensor by tensor,
and with replay the engine's routed experts reach the trainer for every trained token (the trainer's own routers,
in the same float32, choose exactly what the engine chose). The tiny preset applies to the builtin MoE as it does
to the builtin dense model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_training import train_with_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 40


def assert_learns_with_checksummed_syncs(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == STEPS
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.15, f"mean reward first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    for r in rows:  # raygym's server checks every tensor of every sync against the trainer's checksums
        assert r["sync/verified_tensors"] > 0 and r["sync/full_resyncs"] == 0.0, r
        assert r["rollout/logprob_mismatch_mean"] < 1e-3, r


@pytest.mark.parametrize("replay", [False, True], ids=["routers-free", "routing-replay"])
def test_tiny_moe_learns_on_raygyms_server(tmp_path, replay):
    flags = ["--hf-checkpoint", "builtin:tiny-qwen3-moe", "--num-rollout", str(STEPS)]
    rows, log = train_with_engine(flags + (["--use-rollout-routing-replay"] if replay else []), tmp_path / "run")
    assert_learns_with_checksummed_syncs(rows)
    if not replay:
        assert not any(key.startswith("train/routing_replay") for key in rows[0])
        return
    for r in rows:
        assert r["train/routing_replay_tokens"] > 0, r  # the batch carried the engine's routes, and they were used
        assert r["train/routing_replay_differ_decision_frac"] <= 0.01, r
