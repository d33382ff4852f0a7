"""``raygym data prepare``: every source kind gives the same prompt rows; splits, filters, templates,
statistics and errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from raygym.cli.main import main
from raygym.data.prepare import PrepareOptions, prepare_dataset
from raygym.data.prompts import PromptDataset
from raygym.errors import ConfigError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k_sample.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def opts(source, out, **kw) -> PrepareOptions:
    return PrepareOptions(source=str(source), out_dir=str(out), input_key="question", label_key="answer", **kw)


def test_jsonl_csv_parquet_and_saved_dataset_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    with (tmp_path / "rows.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    results = {}
    for name, source in (("jsonl", FIXTURE), ("csv", tmp_path / "rows.csv"),
                         ("parquet", tmp_path / "rows.parquet"), ("saved", tmp_path / "saved")):
        report = prepare_dataset(opts(source, tmp_path / name, seed=3))
        results[name] = read_jsonl(report.train_path)
        assert report.rows_read == len(ROWS) and report.train_rows == len(ROWS)
    assert results["jsonl"] == results["csv"] == results["parquet"] == results["saved"]
    assert sorted(r["prompt"] for r in results["jsonl"]) == sorted(r["question"] for r in ROWS)
    assert {r["metadata"]["source_index"] for r in results["jsonl"]} == set(range(len(ROWS)))


def test_template_label_regex_split_and_stats(tmp_path):
    report = prepare_dataset(opts(FIXTURE, tmp_path, prompt_template="{question}\nanswer: ####",
                                  label_regex=r"####\s*(\S+)", eval_size=2, tokenizer="builtin:tiny-qwen3"))
    train, held = read_jsonl(report.train_path), read_jsonl(report.eval_path)
    assert (len(train), len(held)) == (4, 2) == (report.train_rows, report.eval_rows)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}  # held out, not copied
    answers = {r["question"]: r["answer"].split("####")[-1].strip() for r in ROWS}
    for row in train + held:
        question = row["prompt"].removesuffix("\nanswer: ####")
        assert row["label"] == answers[question]
    stats = json.loads((tmp_path / "stats.json").read_text())
    lengths = sorted(len(r["question"]) + len("\nanswer: ####") for r in ROWS)
    assert stats["prompt_chars"]["min"] == lengths[0] and stats["prompt_chars"]["max"] == lengths[-1]
    assert stats["prompt_tokens"]["max"] == lengths[-1]  # the builtin tokenizer: one token per character
    # raygym trains on the output as it is (default keys prompt/label/metadata)
    from raygym.builtin import build_tokenizer

    dataset = PromptDataset.from_url(report.train_path, build_tokenizer(), shuffle=False)
    assert len(dataset) == 4 and dataset[0].label == train[0]["label"]


def test_fraction_split_is_seeded_and_max_tokens_filters(tmp_path):
    a = prepare_dataset(opts(FIXTURE, tmp_path / "a", eval_size=0.5, seed=1))
    b = prepare_dataset(opts(FIXTURE, tmp_path / "b", eval_size=0.5, seed=1))
    c = prepare_dataset(opts(FIXTURE, tmp_path / "c", eval_size=0.5, seed=2))
    assert read_jsonl(a.eval_path) == read_jsonl(b.eval_path)
    assert a.eval_rows == 3 and (read_jsonl(a.eval_path) != read_jsonl(c.eval_path))
    short = prepare_dataset(opts(FIXTURE, tmp_path / "d", tokenizer="builtin:tiny-qwen3", max_prompt_tokens=110))
    assert short.dropped["too_long"] == sum(len(r["question"]) > 110 for r in ROWS) > 0
    assert all(len(r["prompt"]) <= 110 for r in read_jsonl(short.train_path))


def test_messages_and_chat_template(tmp_path):
    msgs = prepare_dataset(opts(FIXTURE, tmp_path / "m", as_messages=True, system_prompt="be brief"))
    row = read_jsonl(msgs.train_path)[0]
    assert row["prompt"][0] == {"role": "system", "content": "be brief"} and row["prompt"][1]["role"] == "user"
    rendered = prepare_dataset(opts(FIXTURE, tmp_path / "t", chat_template="builtin:tiny-qwen3"))
    # the builtin template concatenates the messages' contents
    assert {r["prompt"] for r in read_jsonl(rendered.train_path)} == {r["question"] for r in ROWS}


@pytest.mark.parametrize("change, needle", [
    ({"input_key": "nope"}, "no column 'nope'"),
    ({"eval_size": 6}, "leaves none to train"),
    ({"eval_size": 1.5}, "eval_size=1.5"),
    ({"label_regex": "(unclosed"}, "not a valid regular expression"),
    ({"label_regex": "####"}, "needs one (group)"),
    ({"prompt_template": "{question"}, "prompt_template"),
    ({"max_prompt_tokens": 10}, "needs a tokenizer"),
    ({"max_prompt_chars": 5}, "every one of 6 rows was dropped"),
])
def test_bad_options_are_config_errors(tmp_path, change, needle):
    fields = {"source": str(FIXTURE), "out_dir": str(tmp_path), "input_key": "question", "label_key": "answer",
              **change}
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        prepare_dataset(PrepareOptions(**fields))


def test_missing_source_and_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        prepare_dataset(opts(tmp_path / "absent.jsonl", tmp_path / "o"))
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell its format"):
        prepare_dataset(opts(tmp_path / "rows.txt", tmp_path / "o"))


def test_hf_source_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match="hf:raygym-no-such/dataset"):
        prepare_dataset(opts("hf:raygym-no-such/dataset", tmp_path / "o"))


def test_cli_prepare_writes_files_and_exit_code_2_on_error(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["data", "prepare", str(FIXTURE), "--out", str(out), "--input-key", "question",
                 "--label-key", "answer", "--prompt-template", "{question}\\nanswer:", "--eval-size", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "train:" in printed and "prompt chars:" in printed
    assert read_jsonl(out / "train.jsonl")[0]["prompt"].endswith("\nanswer:")
    assert len(read_jsonl(out / "eval.jsonl")) == 1
    assert main(["data", "prepare", str(FIXTURE), "--out", str(out), "--input-key", "missing"]) == 2
    assert "no column 'missing'" in capsys.readouterr().err
