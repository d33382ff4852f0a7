"""Data checked before Ray starts: every local row streamed, the first rows of a remote file, parquet
by its schema, chat prompts, and each failure a ConfigError naming file, line, key and fix."""

from __future__ import annotations

import gzip
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from raygym.data.check import REMOTE_ROWS_CHECKED, check_prompt_data
from raygym.errors import ConfigError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gsm8k_sample.jsonl"
GSM8K = {"input_key": "question", "label_key": "answer"}


def write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_every_row_of_a_local_file_is_counted_and_blank_lines_skipped(tmp_path):
    lines = FIXTURE.read_text().splitlines()
    path = write(tmp_path / "g.jsonl", lines[:3] + [""] + lines[3:])
    summary = check_prompt_data(path, **GSM8K)
    assert (summary.rows, summary.complete, summary.columns) == (6, True, ("question", "answer"))
    assert summary.describe() == "6 rows"


def test_gzip_and_file_url(tmp_path):
    path = tmp_path / "g.jsonl.gz"
    path.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert check_prompt_data(str(path), **GSM8K).rows == 6
    assert check_prompt_data("file://" + str(FIXTURE), **GSM8K).rows == 6


def test_bad_row_far_into_a_local_file_is_found(tmp_path):
    rows = [json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(3000)]
    rows[2500] = '{"question": "q", "answer": }'
    with pytest.raises(ConfigError, match=r"line 2501: not valid JSON \(Expecting value at column 29\)"):
        check_prompt_data(write(tmp_path / "big.jsonl", rows), **GSM8K)


def test_remote_file_checks_its_first_rows_only():
    url = f"memory://raygym-check-{uuid.uuid4().hex}/d.jsonl"
    rows = [json.dumps({"prompt": f"p{i}", "label": str(i)}) for i in range(REMOTE_ROWS_CHECKED + 50)]
    rows.append("not json")  # beyond the rows checked before start: the rollout manager finds it
    with fsspec.open(url, "w") as fh:
        fh.write("\n".join(rows) + "\n")
    summary = check_prompt_data(url)
    assert (summary.rows, summary.complete) == (REMOTE_ROWS_CHECKED, False)
    assert "first 1000 rows checked" in summary.describe()
    with pytest.raises(ConfigError, match=f"line {REMOTE_ROWS_CHECKED + 51}"):
        check_prompt_data(url, max_rows=REMOTE_ROWS_CHECKED + 100)


def test_parquet_is_checked_by_its_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([json.loads(line) for line in FIXTURE.read_text().splitlines()])
    pq.write_table(table, tmp_path / "g.parquet")
    assert check_prompt_data(str(tmp_path / "g.parquet"), **GSM8K).rows == 6
    with pytest.raises(ConfigError, match=r"no key 'prompt' for --input-key .* pass --input-key question"):
        check_prompt_data(str(tmp_path / "g.parquet"), label_key="answer")


@pytest.mark.parametrize(
    ("lines", "kwargs", "pattern"),
    [
        (['{"prompt": "a", "label": "1"}', '[1, 2]'], {}, r"line 2: a JSON list, not an object"),
        (['{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}'], {},
         r"line 1: 'prompt' holds chat messages .* --apply-chat-template"),
        (['{"prompt": 5, "label": "1"}'], {}, r"line 1: 'prompt' holds a int"),
        (['{"query": "a", "target": "1"}'], {}, r"no key 'prompt' for --input-key .* pass --input-key query"),
        (['{"prompt": "a", "target": "1"}'], {}, r"no key 'label' for --label-key .* pass --label-key target"),
        (['{"prompt": "a", "zzz": "1"}'], {}, r"pass --label-key with the column that holds the answer"),
        ([""], {}, r"the file has no rows"),
    ],
    ids=["not-an-object", "chat-without-template", "not-text", "input-key", "label-key", "no-guess", "empty"],
)
def test_row_problems(tmp_path, lines, kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        check_prompt_data(write(tmp_path / "d.jsonl", lines), **kwargs)
    assert str(tmp_path / "d.jsonl") in str(info.value)


def test_chat_prompts_pass_with_the_template_and_unlabelled_data_without_label_key(tmp_path):
    path = write(tmp_path / "chat.jsonl", ['{"messages": [{"role": "user", "content": "hi"}]}'])
    assert check_prompt_data(path, input_key="messages", label_key=None, apply_chat_template=True).rows == 1


def test_missing_directory_and_format(tmp_path):
    with pytest.raises(ConfigError, match=r"no such file \(looked for .*nope.jsonl\); check the path given to "
                                          r"--prompt-data"):
        check_prompt_data(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="is a directory"):
        check_prompt_data(str(tmp_path))
    (tmp_path / "rows.txt").write_text('{"prompt": "a"}\n')
    with pytest.raises(ConfigError, match="--format jsonl"):
        check_prompt_data(str(tmp_path / "rows.txt"))
    assert check_prompt_data(str(tmp_path / "rows.txt"), fmt="jsonl", label_key=None).rows == 1
    with pytest.raises(ConfigError, match=r"eval_prompt_data\['dev'\]=.*--eval-prompt-data"):
        check_prompt_data(str(tmp_path / "nope.jsonl"), field="eval_prompt_data['dev']")
