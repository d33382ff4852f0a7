"""raygym.run.metrics: the jsonl log (fresh, resumed), substep timing, traces, progress line and plots."""

from __future__ import annotations

import json
import math

import pytest

from raygym.errors import ConfigError
from raygym.run.metrics import (
    REQUIRED_STEP_KEYS,
    MetricsLogger,
    PhaseTimer,
    apply_substep_timing,
    plot_reward_curve,
    progress_line,
    summary_table,
    write_traces,
)
from raygym.types import Sample


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_writes_one_line_per_step_and_cleans_non_finite(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"rollout/reward_mean": 0.25, "train/loss": float("nan"), "x": float("inf")})
        log.log(1, {"rollout/reward_mean": 0.5})
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 0, "rollout/reward_mean": 0.25, "train/loss": None, "x": "inf"},
                    {"step": 1, "rollout/reward_mean": 0.5}]


def test_fresh_run_replaces_an_old_file_and_resume_keeps_earlier_steps(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(4):
            log.log(step, {"rollout/reward_mean": step / 10})
    # a restart from the checkpoint of step 1 continues at step 2: steps 2-3 are logged again
    with MetricsLogger(tmp_path, resume_from_step=2) as log:
        assert [r["step"] for r in log.history] == [0, 1]
        log.log(2, {"rollout/reward_mean": 0.7})
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"rollout/reward_mean": 1.0})
    assert read_rows(tmp_path / "metrics.jsonl") == [{"step": 0, "rollout/reward_mean": 1.0}]


def test_resume_skips_a_line_cut_by_a_kill(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    with MetricsLogger(tmp_path, resume_from_step=1) as log:
        log.log(1, {"a": 2})
    assert read_rows(tmp_path / "metrics.jsonl") == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]


def test_resume_keeps_one_row_per_step_in_both_files_and_rewrites_by_rename(tmp_path):
    rows = [{"step": 0, "a": 1}, {"step": 1, "a": 1}, {"step": 1, "a": 2}, {"step": 2, "a": 3}]
    for name in ("metrics.jsonl", "prompts.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = {name: (tmp_path / name).stat().st_ino for name in ("metrics.jsonl", "prompts.jsonl")}
    with MetricsLogger(tmp_path, resume_from_step=2) as log:
        log.make_durable()
        assert log.history == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]  # a step logged twice keeps its last row
    for name, inode in before.items():
        assert [r["step"] for r in read_rows(tmp_path / name)] == [0, 1]
        assert (tmp_path / name).stat().st_ino != inode  # a new file renamed over the old: never half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "prompts.jsonl"]


def test_phase_timer_accumulates_per_phase():
    timer = PhaseTimer()
    with timer.phase("train"):
        pass
    timer.add("train", 1.5)
    timer.add("sync", 0.25)
    metrics = timer.as_metrics()
    assert set(metrics) == {"perf/train_time", "perf/sync_time"}
    assert 1.5 <= metrics["perf/train_time"] < 2.0 and metrics["perf/sync_time"] == 0.25


def test_substep_timing_off_keeps_only_core_perf_keys():
    row = {k: 1.0 for k in REQUIRED_STEP_KEYS} | {"perf/log_probs_time": 0.1, "perf/other_time": 0.01,
                                                 "perf/tokens_per_s": 10.0, "train/loss": 0.3}
    assert apply_substep_timing(row, "auto") == row
    off = apply_substep_timing(row, "off")
    assert "perf/log_probs_time" not in off and "perf/other_time" not in off
    assert set(REQUIRED_STEP_KEYS) <= set(off) and off["train/loss"] == 0.3 and off["perf/tokens_per_s"] == 10.0
    with pytest.raises(ConfigError, match="substep_timing='sometimes'"):
        apply_substep_timing(row, "sometimes")


def test_write_traces_saves_only_traced_samples(tmp_path):
    traced = Sample(prompt="next:3=", prompt_tokens=[1, 2, 3], group_index=1, sample_index=2, response_tokens=[4],
                    response_text="4", reward=1.0, weight_version=3, finish_reason="stop", engine="engine 0",
                    trace={"queued": 10.0, "sent": 10.5, "done": 11.0, "engine": 0, "attempts": 1})
    plain = Sample(prompt="next:1=", prompt_tokens=[1], group_index=0)
    path = write_traces(tmp_path, 7, [plain, traced])
    assert path == str(tmp_path / "traces" / "step_000007.jsonl")
    (line,) = read_rows(tmp_path / "traces" / "step_000007.jsonl")
    assert line["step"] == 7 and line["group_index"] == 1 and line["sample_index"] == 2
    assert line["prompt_tokens"] == 3 and line["response_tokens"] == 1 and line["reward"] == 1.0
    assert line["done"] - line["queued"] == 1.0 and line["attempts"] == 1
    assert write_traces(tmp_path, 8, [plain]) is None
    assert not (tmp_path / "traces" / "step_000008.jsonl").exists()


def test_progress_line_and_summary_table():
    row = {"step": 4, "rollout/reward_mean": 0.5, "rollout/response_len_mean": 3.0, "perf/step_time": 1.25,
           "perf/rollout_time": 0.5, "perf/train_time": 0.5, "perf/sync_time": 0.1, "perf/tokens_per_s": 800.0}
    line = progress_line(row, 10)
    # steps are numbered from 0 (as in metrics.jsonl and iter_*); [5/10] counts the steps done
    assert "step 4 [5/10]" in line and "reward 0.500" in line and "1.25s" in line and "800 tok/s" in line
    assert "reward -" in progress_line({"step": 0}, 1)  # missing values do not crash the line
    table = summary_table([row, {**row, "step": 5, "rollout/reward_mean": 0.75}])
    assert table.row_count >= 3


def test_reward_curve_png(tmp_path):
    history = [{"step": i, "rollout/reward_mean": math.sin(i) ** 2} for i in range(30)]
    history[9]["eval/digits/reward_mean"] = 0.5
    path = plot_reward_curve(history, tmp_path / "curve.png")
    assert path and (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_reward_curve([{"step": 0}], tmp_path / "none.png") is None
