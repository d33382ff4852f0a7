"""Prompt datasets: formats and URLs, templating, errors naming file and row, seeded epochs, resume."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from raygym.builtin import NEXT_DIGIT_TASK, build_tokenizer
from raygym.config import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.data.prompts import (
    PromptDataset,
    dataset_from_config,
    eval_dataset_urls,
    load_eval_datasets,
    parse_chat_template_kwargs,
    read_rows,
)
from raygym.errors import ConfigError

FIXTURE = str(Path(__file__).parents[1] / "fixtures" / "gsm8k_sample.jsonl")
GSM8K = {"input_key": "question", "label_key": "answer", "metadata_key": None}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def digit_rows(n: int) -> list[dict]:
    return [{"prompt": f"next:{i % 10}=", "label": str((i + 1) % 10), "metadata": {"i": i}} for i in range(n)]


def test_gsm8k_fixture_rows_tokenized_once_without_special_tokens(tok):
    ds = PromptDataset.from_url(FIXTURE, tok, shuffle=False, **GSM8K)
    raw = [json.loads(line) for line in open(FIXTURE)]
    assert len(ds) == len(raw) == 6
    for i, row in enumerate(ds.next_batch(len(raw))):
        data_index, prompt, label, metadata, tokens = row
        assert (data_index, prompt, label, metadata) == (i, raw[i]["question"], raw[i]["answer"], {})
        assert tokens == tok.encode(raw[i]["question"], add_special_tokens=False)
        assert tok.eos_token_id not in tokens


def test_file_url_memory_url_and_parquet_give_the_same_rows(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = digit_rows(5)
    local = write_jsonl(tmp_path / "d.jsonl", rows)
    with fsspec.open("memory://raygym-test/d.jsonl", "wt") as fh:
        fh.write(Path(local).read_text())
    table = pa.Table.from_pylist([{**r, "metadata": json.dumps(r["metadata"])} for r in rows])
    with fsspec.open("memory://raygym-test/d.parquet", "wb") as fh:
        pq.write_table(table, fh)
    loaded = [
        PromptDataset.from_url(url, tok, shuffle=False).next_batch(5)
        for url in (
            local,
            "file://" + local,
            "memory://raygym-test/d.jsonl",
            "memory://raygym-test/d.parquet",
        )
    ]
    assert all(batch == loaded[0] for batch in loaded)
    assert [r.metadata for r in loaded[0]] == [{"i": i} for i in range(5)]


def test_builtin_dataset_resolves_through_materialize(tok, tmp_path):
    ds = PromptDataset.from_url(NEXT_DIGIT_TASK, tok, cache_dir=str(tmp_path), shuffle=False)
    first = ds.next_batch(3)
    assert len(ds) == 1024
    for row in first:
        digit = int(row.prompt.removeprefix("next:").removesuffix("="))
        assert row.label == str((digit + 1) % 10)


def test_malformed_json_row_names_file_and_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [digit_rows(1)[0], '{"prompt": "x", ', digit_rows(1)[0]])
    with pytest.raises(ConfigError, match=r"bad\.jsonl.*line 2 \(row 1\).*not valid JSON"):
        read_rows(path)


def test_non_object_row_is_rejected(tok, tmp_path):
    path = write_jsonl(tmp_path / "list.jsonl", ['["a", "b"]'])
    with pytest.raises(ConfigError, match=r"list\.jsonl.*row 0.*expected a JSON object"):
        read_rows(path)


@pytest.mark.parametrize("missing", ["prompt", "label"])
def test_missing_key_names_file_row_and_key(tok, tmp_path, missing):
    rows = digit_rows(4)
    del rows[2][missing]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"rows\.jsonl' row 2: missing \w+_key '{missing}'"):
        PromptDataset.from_url(path, tok)


def test_missing_file_and_unknown_format_are_config_errors(tok, tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        read_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="cannot tell the format"):
        read_rows(str(tmp_path / "rows.csv"))


def test_shuffle_is_a_seeded_permutation_per_epoch(tok):
    rows = digit_rows(10)

    def order(seed: int, n: int) -> list[int]:
        return [r.data_index for r in PromptDataset(rows, tok, seed=seed).next_batch(n)]

    a = order(7, 30)
    assert a == order(7, 30)  # same seed, same order, across epochs
    assert a != order(8, 30)
    epochs = [a[0:10], a[10:20], a[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # a fresh permutation every epoch
    unshuffled = [r.data_index for r in PromptDataset(rows, tok, shuffle=False).next_batch(25)]
    assert unshuffled == list(range(10)) * 2 + list(range(5))


def test_data_position_restores_exactly(tok):
    rows = digit_rows(7)
    ds = PromptDataset(rows, tok, seed=3)
    ds.next_batch(12)  # into epoch 1
    state = json.loads(json.dumps(ds.state_dict()))  # as a checkpoint would store it
    assert (state["epoch"], state["offset"]) == (1, 5)
    expected = ds.next_batch(9)
    resumed = PromptDataset(rows, tok, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_batch(9) == expected
    with pytest.raises(ConfigError, match="the dataset has 6"):
        PromptDataset(rows[:6], tok, seed=3).load_state_dict(state)


def test_chat_template_with_generation_prompt_and_kwargs(tok):
    templated = build_tokenizer()
    templated.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}{% if think %}#{% endif %}"
    )
    rows = [
        {"prompt": "2+2=", "label": "4"},
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+3="}],
            "label": "6",
        },
    ]
    ds = PromptDataset(
        rows, templated, apply_chat_template=True, apply_chat_template_kwargs='{"think": true}', shuffle=False
    )
    first, second = ds.next_batch(2)
    assert first.prompt_tokens == templated.encode("u:2+2=\na:#", add_special_tokens=False)
    assert second.prompt_tokens == templated.encode("s:be brief\nu:3+3=\na:#", add_special_tokens=False)
    assert first.prompt == "2+2="  # the raw prompt is kept for reward functions


def test_chat_messages_without_template_are_rejected(tok):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}]
    with pytest.raises(
        ConfigError, match="row 0: input_key 'prompt' holds chat messages.*apply_chat_template"
    ):
        PromptDataset(rows, tok)


def test_bad_chat_template_kwargs():
    assert parse_chat_template_kwargs("") == {}
    assert parse_chat_template_kwargs({"a": 1}) == {"a": 1}
    with pytest.raises(ConfigError, match="apply_chat_template_kwargs"):
        parse_chat_template_kwargs("[1, 2]")


def test_max_prompt_len_filter_and_truncate(tok):
    rows = [{"prompt": "1" * n, "label": ""} for n in (3, 8, 5, 9)]
    filtered = PromptDataset(rows, tok, max_prompt_len=5, shuffle=False)
    assert [r.data_index for r in filtered.next_batch(2)] == [0, 2]
    assert filtered.num_filtered == 2
    truncated = PromptDataset(
        [{"prompt": "12345678", "label": ""}], tok, max_prompt_len=3, prompt_len_policy="truncate"
    )
    assert truncated[0].prompt_tokens == tok.encode("678", add_special_tokens=False)
    with pytest.raises(ConfigError, match="no usable rows.*rollout_max_prompt_len=2"):
        PromptDataset(rows, tok, max_prompt_len=2)


def test_config_and_eval_datasets(tok, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", digit_rows(6))
    evalp = write_jsonl(tmp_path / "eval.jsonl", digit_rows(4))
    cfg = TrainConfig(
        dataset=DatasetConfig(
            prompt_data=train,
            input_key="prompt",
            label_key="label",
            metadata_key="metadata",
            apply_chat_template=False,
            eval_prompt_data={"digits": evalp},
        ),
        recipe=Recipe(
            rollout_shuffle=False,
            seed=1,
            rollout_max_prompt_len=None,
            eval_config={"datasets": [{"name": "more", "path": evalp}]},
        ),
        model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"),
    )
    assert [r.data_index for r in dataset_from_config(cfg, tok).next_batch(3)] == [0, 1, 2]
    urls = eval_dataset_urls(cfg)
    assert urls == {"digits": evalp, "more": evalp}
    evals = load_eval_datasets(urls, tok, shuffle=True, seed=5)
    assert [r.data_index for r in evals["digits"].next_batch(4)] == [0, 1, 2, 3]  # eval never shuffles
