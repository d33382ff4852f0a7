"""raygym report without a browser: reading run directories (partial, cut and odd files), the chart series,
config differences, the embedded page data, and --watch rewriting the file as a run grows. The page
itself is rendered in Chromium by tests/e2e/test_after_training.py."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from raygym.config import Recipe
from raygym.errors import ConfigError
from raygym.report import build_report, watch_report, write_report
from raygym.report.build import load_runs, report_data
from raygym.report.content import CHARTS, chart_series, config_differences


def _run(root: Path, name: str, lr: float, steps: int, *, traces: bool = True) -> Path:
    run = root / name
    (run / "traces").mkdir(parents=True)
    config = {"recipe": {"lr": lr, "seed": 1, "eval_config": None}, "model": {"hf_checkpoint": "m"},
              "dataset": {"prompt_data": "d.jsonl"}, "run_id": name, "output_dir": str(run)}
    (run / "config.json").write_text(json.dumps(config))
    rows = []
    for step in range(steps):
        rows.append(json.dumps({"step": step, "rollout/reward_mean": 0.1 * step * lr * 1000, "train/entropy": 3.0 - step,
                                "perf/step_time": 1.0, "perf/sync_time": 0.25, "sync/bytes": 1000.0 * (step + 1),
                                "train/grad_norm": "inf" if step == 1 else 0.5,
                                **({"eval/gsm8k/reward_mean": 0.5, "eval/gsm8k/pass@4": 0.75} if step % 2 else {})}))
    (run / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 99, "rollout/rew')  # a line being written
    if traces:
        (run / "traces" / "step_000000.jsonl").write_text(json.dumps({
            "step": 0, "prompt": "2+2=", "response_text": "4</script><script>alert(1)</script>", "reward": 1.0,
            "label": "4", "finish_reason": "stop", "engine_name": "engine 0"}) + "\n")
    return run


def _embedded(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_two_runs_series_differences_and_traces(tmp_path):
    a, b = _run(tmp_path, "a", 1e-3, 4), _run(tmp_path, "b", 2e-3, 3, traces=False)
    runs = load_runs([str(a), str(b)])
    assert [len(r.rows) for r in runs] == [4, 3]  # the cut last line is skipped
    reward = next(c for c in CHARTS if c.id == "reward")
    series = chart_series(runs, reward)
    assert [(s["run"], s["key"], len(s["points"])) for s in series] == [(0, "rollout/reward_mean", 4),
                                                                         (1, "rollout/reward_mean", 3)]
    grad = chart_series(runs, next(c for c in CHARTS if c.id == "grad-norm"))
    assert [p[0] for p in grad[0]["points"]] == [0, 2, 3]  # the infinite value is left out, not plotted
    phases = chart_series(runs, next(c for c in CHARTS if c.id == "phases"))
    assert {s["key"] for s in phases} == {"perf/step_time", "perf/sync_time"}
    evals = chart_series(runs, next(c for c in CHARTS if c.id == "eval-pass"))
    assert evals[0]["points"] == [[1, 0.75], [3, 0.75]]
    diff = config_differences(runs)
    assert [row["field"] for row in diff] == ["recipe.lr"] and diff[0]["values"] == ["0.001", "0.002"]

    html = build_report([str(a), str(b)])
    assert "</script><script>alert" not in html  # trace text cannot end the data block
    data = _embedded(html)
    assert data == json.loads(json.dumps(report_data(runs) | {"generated": data["generated"]}))
    assert [t["response"] for t in data["traces"]] == ["4</script><script>alert(1)</script>"]
    assert data["runs"][0]["steps"] == 4 and data["runs"][0]["eval_last"] == {"gsm8k": 0.5}
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing fetched from anywhere


def test_single_run_lists_differences_from_the_defaults(tmp_path):
    data = report_data(load_runs([str(_run(tmp_path, "solo", 1e-3, 2))]))
    fields = {row["field"]: row for row in data["config"]["rows"]}
    assert data["config"]["single"] and fields["recipe.lr"]["values"] == ["0.001"]
    assert fields["recipe.lr"]["default"] == json.dumps(Recipe().lr) and "recipe.eval_config" not in fields


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="neither config.json nor metrics.jsonl"):
        build_report([str(tmp_path)])
    with pytest.raises(ConfigError, match="no run directory"):
        build_report([])


def test_watch_rewrites_as_the_run_grows(tmp_path):
    run = _run(tmp_path, "live", 1e-3, 1)
    out = tmp_path / "report.html"
    stop = threading.Event()
    writes: list[int] = []
    grown = threading.Event()

    def on_write(path: str) -> None:
        data = _embedded(Path(path).read_text())
        writes.append(data["runs"][0]["steps"])
        if len(writes) == 1:  # the run logs two more steps after the first write
            with (run / "metrics.jsonl").open("w") as f:
                for step in range(3):
                    f.write(json.dumps({"step": step, "rollout/reward_mean": 0.1}) + "\n")
        elif data["runs"][0]["steps"] == 3:
            grown.set()
            stop.set()

    thread = threading.Thread(target=watch_report, args=([str(run)], str(out)),
                              kwargs={"interval_s": 0.05, "stop": stop, "on_write": on_write})
    thread.start()
    assert grown.wait(30), writes
    thread.join(30)
    assert writes[0] == 1 and writes[-1] == 3
    assert '<meta http-equiv="refresh" content="1">' in out.read_text()
    assert not list(tmp_path.glob(".report.html.tmp*"))
    assert '<meta http-equiv="refresh"' not in Path(write_report([str(run)], str(tmp_path / "once.html"))).read_text()
