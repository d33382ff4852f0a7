"""``raygym bench`` without running a benchmark: the listing, an unknown name, how NAME's arguments and ``--out``
are told apart, the charts and HTML report drawn from given rows, and docs/benchmarks.md against its records."""

from __future__ import annotations

import ast
import base64
import json
import re
from pathlib import Path

import pytest

from raygym.bench import FOLDER, NOT_BENCHMARKS, benchmark_names
from raygym.bench.charts import phase_bars, ratio_chart, ratio_points, report_html
from raygym.bench.record import BEGIN, END, latest, load_records, records_from_run, render_doc
from raygym.cli import bench as bench_cli
from raygym.cli.main import main
from raygym.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs"
PNG = b"\x89PNG\r\n\x1a\n"

E2E_ROWS = [  # rows as raygym bench e2e prints them (abridged)
    {"figure": "raygym_step_split_sync", "step_s": 0.73, "rollout_s": 0.26, "log_probs_s": 0.0, "train_s": 0.42,
     "sync_s": 0.026, "eval_s": 0.0, "other_s": 0.02, "setup": {"model": "ref", "task": "builtin:next-digit"},
     "machine": {"cores": 2, "device": "cpu"}},
    {"figure": "trl_step_split", "step_s": 0.76, "generate_s": 0.23, "reward_s": 0.001, "train_s": 0.53,
     "samples_per_s_ratio": None, "setup": {"model": "ref", "task": "builtin:next-digit"}},
    {"figure": "raygym_vs_trl_step_s", "value": 0.728, "baseline": 0.758, "ratio": 0.96,
     "setup": {"model": "ref", "task": "builtin:next-digit"}},
    {"figure": "train_tokens_per_s", "value": 12544.2, "baseline": "fixed micro_batch_size=8", "ratio": 1.057},
    {"figure": "flag", "ratio": True},  # a bool is no ratio
]


def images(page: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_list_names_every_benchmark_once_with_a_line_each(capsys):
    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [*benchmark_names(), "record"]
    assert {"async", "e2e", "rollout", "weight_sync", "train_step", "gpu_check_vllm"} <= set(names)
    assert not set(benchmark_names()) & NOT_BENCHMARKS
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # a name and what it measures
    assert "End-to-end step time" in lines[names.index("e2e")]


@pytest.mark.parametrize("name", benchmark_names())
def test_every_listed_benchmark_runs_as_a_module(name):
    tree = ast.parse((FOLDER / f"{name}.py").read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), f"{name}: no main()"
    assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body), name
    assert ast.get_docstring(tree), f"{name}: no docstring for --list"


def test_an_unknown_name_is_a_config_error_listing_the_benchmarks(capsys):
    assert main(["bench", "e2ee"]) == 2
    err = capsys.readouterr().err
    assert "'e2ee'" in err and "no such benchmark" in err
    for name in ("async", "e2e", "weight_sync"):
        assert name in err
    with pytest.raises(ConfigError, match="rollout_timing"):  # a part of a benchmark is not one
        bench_cli.check_name("rollout_timing")


def test_the_benchmark_gets_its_arguments_in_order_and_out_writes_the_report(monkeypatch, tmp_path, capsys):
    ran: list[tuple[str, list[str]]] = []

    def fake_run(name, args):
        ran.append((name, list(args)))
        return 0, E2E_ROWS, 1.5

    monkeypatch.setattr(bench_cli, "run_benchmark", fake_run)
    out = tmp_path / "out"
    assert main(["bench", "e2e", "--steps", "2", "--out", str(out), "--models", "tiny", "--help"]) == 0
    assert ran == [("e2e", ["--steps", "2", "--models", "tiny", "--help"])]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows == E2E_ROWS
    run = json.loads((out / "run.json").read_text())
    assert run["command"] == "raygym bench e2e --steps 2 --models tiny --help" and run["exit"] == 0
    page = (out / "report.html").read_text()
    assert len(images(page)) == 2 and "raygym bench e2e --steps 2" in page
    assert "wrote" in capsys.readouterr().err


def test_a_failing_benchmark_passes_its_exit_status_on(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_cli, "run_benchmark", lambda name, args: (3, [], 0.2))
    assert main(["bench", "serve", "--out", str(tmp_path)]) == 3
    assert (tmp_path / "results.jsonl").read_text() == ""
    assert "printed no result" in (tmp_path / "report.html").read_text()


def test_ratio_and_phase_rows_are_read_from_the_rows():
    assert ratio_points(E2E_ROWS) == [("raygym_vs_trl_step_s (ref, builtin:next-digit)", 0.96),
                                      ("train_tokens_per_s (vs fixed micro_batch_size=8)", 1.057)]
    bars = phase_bars(E2E_ROWS)
    assert [label for label, _ in bars] == ["raygym_step_split_sync (ref, builtin:next-digit)",
                                            "trl_step_split (ref, builtin:next-digit)"]
    assert bars[0][1] == {"rollout": 0.26, "log_probs": 0.0, "train": 0.42, "sync": 0.026, "eval": 0.0, "other": 0.02}
    assert bars[1][1] == {"generate": 0.23, "reward": 0.001, "train": 0.53}
    engine_step = {"figure": "verified_step_s", "rollout_time": 0.06, "train_time": 0.05, "sync_time": 0.02}
    assert phase_bars([engine_step]) == [("verified_step_s", {"rollout": 0.06, "train": 0.05, "sync": 0.02})]


def test_the_report_is_one_html_file_with_the_charts_embedded():
    page = report_html(E2E_ROWS, "raygym bench e2e", {"command": "raygym bench e2e <tiny>"})
    pngs = images(page)
    assert len(pngs) == 2 and all(p.startswith(PNG) and len(p) > 2000 for p in pngs)  # ratios, phases
    assert "Ratios" in page and "Time by phase" in page
    assert "raygym bench e2e &lt;tiny&gt;" in page  # escaped
    assert "cores=2, device=cpu" in page  # the machine of the rows
    assert page.count("<tr><td>") == len(E2E_ROWS)  # one table row per JSON row
    assert 'src="http' not in page and "<script" not in page  # nothing fetched
    only_ratios = report_html([E2E_ROWS[2]], "t")
    assert len(images(only_ratios)) == 1 and "Time by phase" not in only_ratios
    assert ratio_chart([("below", 0.002), ("above", 13.2)]).startswith(PNG)  # a log scale


def test_docs_benchmarks_md_is_what_its_records_give():
    doc = (DOCS / "benchmarks.md").read_text()
    records = load_records((DOCS / "bench-records.jsonl").read_text())
    assert render_doc(doc, records) == doc, "docs/benchmarks.md is out of date: run `raygym bench record`"
    assert (DOCS / "bench-ratios.png").read_bytes().startswith(PNG)


def test_a_later_record_replaces_the_earlier_one_of_its_figure_and_label():
    def rec(label: str, ratio: float, date: str = "2026-12-06") -> dict:
        return {"figure": "f", "label": label, "ratio": ratio, "command": "raygym bench x", "machine": "2 cores",
                "date": date}

    records = [rec("a", 1.0), rec("b", 2.0), rec("a", 3.0), rec("c", 4.0, "2026-12-01")]
    assert [(r["label"], r["ratio"]) for r in latest(records)] == [("a", 3.0), ("b", 2.0), ("c", 4.0)]
    table = render_doc(f"intro\n{BEGIN}\nold\n{END}\nprose\n", records)
    assert table.startswith(f"intro\n{BEGIN}\n") and table.endswith(f"{END}\nprose\n") and "old" not in table
    assert "| **3** |" in table and "| **1** |" not in table
    with pytest.raises(ConfigError, match="no generated section"):
        render_doc("no markers", records)
    with pytest.raises(ConfigError, match="line 1: no machine"):
        load_records(json.dumps({"figure": "f", "label": "a", "command": "c", "date": "d"}))


def test_a_runs_ratios_become_records():
    run = {"benchmark": "e2e", "command": "raygym bench e2e --steps 2", "started": "2026-12-07T10:00:00+00:00"}
    added = records_from_run(E2E_ROWS, run)
    assert [(r["figure"], r["label"], r["ratio"]) for r in added] == [
        ("raygym_vs_trl_step_s", "ref, builtin:next-digit", 0.96),
        ("train_tokens_per_s", "vs fixed micro_batch_size=8", 1.057)]
    assert added[0]["date"] == "2026-12-07" and added[0]["command"] == run["command"]
    assert load_records("\n".join(json.dumps(r) for r in added)) == added
