"""RolloutManager on local Ray with two real EngineActors (raygym's server, tiny model, CPU):
a full batch with exactly the expected samples, a server killed mid-batch (detected, restarted,
re-admitted only after the weight re-sync, no sample lost or duplicated) and DAPO dynamic sampling."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from raygym.builtin import build_tokenizer, next_digit_reward
from raygym.config import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.data.prompts import PromptDataset
from raygym.engines.actor import EngineActor
from raygym.presets import tiny
from raygym.rollout.manager import RolloutManager, RolloutSettings

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "digits.jsonl"
    rows = [{"prompt": f"next:{i % 10}=", "label": str((i + 1) % 10), "metadata": {"row": i}} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_path, tmp_path_factory):
    ray = ray_local
    Actor = ray.remote(num_cpus=0, max_concurrency=16)(EngineActor)
    log_dir = str(tmp_path_factory.mktemp("engine-logs"))
    handles = [
        Actor.remote(tiny().replace(seed=i, sglang_max_running_requests=32), i, tiny_model_path, [], "127.0.0.1", "raygym",
                     startup_timeout=180.0, device="cpu", log_dir=log_dir)
        for i in range(2)
    ]
    ray.get([h.start.remote() for h in handles], timeout=240)
    yield handles
    ray.get([h.shutdown.remote() for h in handles], timeout=60)
    for h in handles:
        ray.kill(h)


def make_cfg(prompt_file: str, model_path: str, **recipe) -> TrainConfig:
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 3, "global_batch_size": 12,
              "rollout_max_response_len": 6, "rm_type": "next_digit", "seed": 11,
              "rollout_health_check_first_wait": 0, "rollout_health_check_interval": 1,
              "rollout_health_check_timeout": 10, **recipe}
    return TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=model_path),
                       dataset=DatasetConfig(prompt_data=prompt_file))


def expected_rows(prompt_file: str, seed: int, n: int):
    return PromptDataset.from_url(prompt_file, build_tokenizer(), seed=seed).next_batch(n)


def check_batch(samples, rows, n: int, max_len: int) -> None:
    """Exactly one sample per (group, slot), groups in data order, every field consistent."""
    assert [(s.group_index, s.sample_index) for s in samples] == [(g, j) for g in range(len(rows)) for j in range(n)]
    for s in samples:
        row = rows[s.group_index]
        assert (s.data_index, s.prompt, s.label, s.prompt_tokens) == (row.data_index, row.prompt, row.label,
                                                                      row.prompt_tokens)
        assert 1 <= s.response_length <= max_len
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
        assert all(lp <= 0.0 for lp in s.rollout_log_probs) and s.loss_mask == [1] * s.response_length
        assert s.finish_reason in ("stop", "length") and s.status in ("completed", "truncated")
        assert s.reward == next_digit_reward(s.response_text, s.label) and s.reward_error is None


def test_full_batch_then_killed_engine_recovers(engines, prompt_file, tiny_model_path):
    cfg = make_cfg(prompt_file, tiny_model_path, capture_trace=True, trace_sample_limit=5)
    rows = expected_rows(prompt_file, seed=11, n=4 + 8)

    async def scenario():
        manager = RolloutManager(cfg, engines, tiny_model_path)
        try:
            first = await manager.generate(rollout_id=0, weight_version=0)
            check_batch(first, rows[:4], n=3, max_len=6)
            m = manager.metrics()
            assert m["rollout/samples"] == 12 and m["rollout/engine0_requests"] + m["rollout/engine1_requests"] == 12
            assert m["rollout/engine0_requests"] > 0 and m["rollout/engine1_requests"] > 0
            assert m["rollout/generated_tokens"] == sum(s.response_length for s in first)
            assert m["rollout/reward_errors"] == 0 and m["rollout/engine_failures"] == 0
            traced = [s.trace for s in first if s.trace]
            assert len(traced) == 5 and all(t["queued"] <= t["sent"] <= t["done"] for t in traced)
            assert manager.data_state()["train"]["offset"] == 4

            # Longer responses so the kill lands while engine 0 has requests in flight.
            longer = make_cfg(prompt_file, tiny_model_path, capture_trace=True, trace_sample_limit=5,
                              rollout_batch_size=8, rollout_max_response_len=24,
                              sglang_request_params={"ignore_eos": True})
            manager.settings = RolloutSettings.from_config(longer)
            old_pid = await engines[0].pid.remote()
            step = asyncio.create_task(manager.generate(rollout_id=1, weight_version=1))
            while manager.pool.router.outstanding(0) == 0:
                await asyncio.sleep(0.01)
            os.kill(old_pid, signal.SIGKILL)  # the server this test's engine started
            second = await step
            check_batch(second, rows[4:12], n=3, max_len=24)
            assert all(s.response_length == 24 for s in second)
            assert {s.weight_version for s in second} == {0}  # what the engines report: never re-synced here
            assert manager.metrics()["rollout/engine_failures"] >= 1
            assert manager.metrics()["rollout/request_retries"] >= 1

            await manager.pool.wait_for_recoveries()
            assert await engines[0].pid.remote() != old_pid and await engines[0].alive.remote()
            assert manager.engines_needing_weights() == [0]  # restarted with the base weights
            assert manager.mark_engine_synced(0, weight_version=0) is False  # stale: stays out
            manager.settings = RolloutSettings.from_config(cfg)
            await manager.generate(rollout_id=2, weight_version=1)
            assert manager.metrics()["rollout/engine0_requests"] == 0  # no traffic before the re-sync
            assert manager.mark_engine_synced(0, weight_version=1) is True
            third = await manager.generate(rollout_id=3, weight_version=1)
            assert manager.metrics()["rollout/engine0_requests"] > 0
            assert len(third) == 12
        finally:
            await manager.close()

    asyncio.run(asyncio.wait_for(scenario(), timeout=150))


def even_rows_only(sample) -> float:
    """Varying rewards for prompts from even rows, all-equal rewards for odd rows."""
    return float(sample.sample_index) if sample.metadata["row"] % 2 == 0 else 1.0


def test_dynamic_sampling_keeps_rollout_batch_size_groups(engines, prompt_file, tiny_model_path):
    cfg = make_cfg(prompt_file, tiny_model_path, rm_type=None, custom_rm_function=even_rows_only,
                   dynamic_sampling_filter_path="raygym.rollout.filters:drop_uniform_reward_groups",
                   over_sampling_batch_size=5, rollout_max_response_len=3)

    async def scenario():
        manager = RolloutManager(cfg, engines, tiny_model_path)
        try:
            samples = await manager.generate(rollout_id=0, weight_version=0)
            return samples, manager.metrics(), manager.data_state()
        finally:
            await manager.close()

    samples, metrics, state = asyncio.run(asyncio.wait_for(scenario(), timeout=90))
    groups = [samples[i : i + 3] for i in range(0, len(samples), 3)]
    assert len(groups) == 4 and [g[0].group_index for g in groups] == [0, 1, 2, 3]
    assert all(g[0].metadata["row"] % 2 == 0 for g in groups)
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0] * 4
    consumed = expected_rows(prompt_file, seed=11, n=state["train"]["offset"])
    position = {r.data_index: k for k, r in enumerate(consumed)}
    kept_positions = [position[s.data_index] for s in samples[::3]]
    assert kept_positions == sorted(kept_positions)  # groups in data order
    assert all(consumed[k].metadata["row"] % 2 == 0 for k in kept_positions)
    assert any(r.metadata["row"] % 2 for r in consumed[:5])  # the first round had groups to drop (seed 11)
    assert metrics["rollout/dynamic_kept_groups"] == 4 and metrics["rollout/dynamic_dropped_groups"] >= 1
    started = metrics["rollout/dynamic_kept_groups"] + metrics["rollout/dynamic_dropped_groups"]
    assert started + metrics["rollout/dynamic_aborted_groups"] == len(consumed)  # every prompt accounted for
