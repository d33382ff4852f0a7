"""The builtin ``long-tail`` task: its rows (seeded, one copy row in eight), its reward (``long_tail``), its
data path (``builtin:long-tail`` through the tokenizer and the dataset loader) and the start-up checks that
keep each builtin task's reward on its own data."""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path

import pytest

from raygym import DatasetConfig, ModelConfig, TrainConfig
from raygym.builtin import (
    COPY_EVERY,
    LONG_TAIL_TASK,
    NEXT_DIGIT_ROWS,
    TINY_ARCH,
    build_tokenizer,
    long_tail_reward,
    long_tail_rows,
    materialize_dataset,
)
from raygym.data import PromptDataset
from raygym.errors import ConfigError
from raygym.preflight import preflight
from raygym.presets import tiny
from raygym.rewards import RewardModel, default_rm_type
from raygym.types import Sample

COPY_ALPHABET = set(string.digits + string.ascii_lowercase)


def is_copy(row: dict) -> bool:
    return row["prompt"].startswith("copy:")


def test_rows_are_seeded_one_in_eight_copy_rows_and_well_formed():
    rows = long_tail_rows(NEXT_DIGIT_ROWS, seed=0)
    assert rows == long_tail_rows(NEXT_DIGIT_ROWS, seed=0) and rows != long_tail_rows(NEXT_DIGIT_ROWS, seed=1)
    copies = [r for r in rows if is_copy(r)]
    assert len(rows) == 1024 and len(copies) == 1024 // COPY_EVERY == 128
    for row in copies:
        assert row["prompt"] == f"copy:{row['label']}=" and 24 <= len(row["label"]) <= 56
        assert set(row["label"]) <= COPY_ALPHABET
    lengths = [len(r["label"]) for r in copies]
    assert min(lengths) < 30 and max(lengths) > 50  # the lengths spread over the range
    for row in rows:
        if not is_copy(row):
            digit = int(row["prompt"].removeprefix("next:").removesuffix("="))
            assert row["label"] == str((digit + 1) % 10)
    # the copy rows are spread through the data, not bunched at one end
    positions = [i for i, r in enumerate(rows) if is_copy(r)]
    assert positions[0] < 64 and positions[-1] > 960


@pytest.mark.parametrize(
    "response, label, reward",
    [("8", "8", 1.0), (" 8 ", "8", 1.0), ("8x", "8", 0.75), ("3", "8", 0.5), ("x", "8", 0.0),  # next rows
     ("abcd1234", "abcd1234", 1.0),            # exact copy: 0.75 + 0.25
     (" abcd1234\n", "abcd1234", 1.0),         # stripped
     ("abcd", "abcd1234", 0.375),              # half the label: 0.75 * 4/8
     ("abcd1234x", "abcd1234", 0.75),          # all of it and more: no exact bonus
     ("abxd1234", "abcd1234", 0.1875),         # the prefix stops at the first difference: 0.75 * 2/8
     ("", "abcd1234", 0.0), ("zbcd1234", "abcd1234", 0.0)],
)  # fmt: skip
def test_reward_by_hand(response, label, reward):
    assert long_tail_reward(response, label) == pytest.approx(reward)


def test_rm_type_long_tail_scores_samples_and_is_the_default_of_the_task():
    def sample(response: str, label: str) -> Sample:
        return Sample(prompt="p", prompt_tokens=[1], group_index=0, sample_index=0, response_text=response,
                      label=label)

    samples = [sample("9", "9"), sample("k3xq", "k3xq7"), sample("nope", "k3xq7")]
    asyncio.run(RewardModel("long_tail").score(samples))
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.6, 0.0])
    assert default_rm_type(tiny().replace(rm_type=None), LONG_TAIL_TASK) == "long_tail"


def test_materialised_rows_load_and_fit_the_tiny_model(tmp_path):
    path = materialize_dataset(LONG_TAIL_TASK, tmp_path, seed=0)
    assert Path(path).name == "long-tail-seed0-n1024.jsonl"
    assert [json.loads(line) for line in Path(path).read_text().splitlines()] == long_tail_rows(1024, 0)
    tok = build_tokenizer()
    ds = PromptDataset.from_url(LONG_TAIL_TASK, tok, cache_dir=str(tmp_path / "cache"), shuffle=False)
    rows = ds.next_batch(len(ds))
    assert len(rows) == 1024 and sum(r.prompt.startswith("copy:") for r in rows) == 128
    longest = max(rows, key=lambda r: len(r.prompt))
    ids = tok.encode(longest.prompt)
    assert tok.decode(ids) == longest.prompt  # every character has a token of its own
    assert len(ids) + 64 <= TINY_ARCH["max_position_embeddings"]  # with --rollout-max-response-len 64


def config(tmp_path: Path, prompt_data: str, rm_type: str | None) -> TrainConfig:
    return TrainConfig(recipe=tiny().replace(rm_type=rm_type), model=ModelConfig(hf_checkpoint="builtin:tiny-qwen3"),
                       dataset=DatasetConfig(prompt_data=prompt_data), output_dir=str(tmp_path / "run"))


def test_preflight_keeps_each_builtin_reward_on_its_own_task(tmp_path):
    facts = preflight(config(tmp_path, LONG_TAIL_TASK, "long_tail"))
    assert (facts.data.rows, [f.name for f in facts.rewards]) == (1024, ["long_tail"])
    assert [f.name for f in preflight(config(tmp_path, LONG_TAIL_TASK, None)).rewards] == ["long_tail"]
    # the tiny preset's next_digit on the long-tail task: the fix names the task's own reward
    with pytest.raises(ConfigError, match=r"rm_type='next_digit' .* prompt_data='builtin:long-tail' .* "
                                          r"pass --rm-type long_tail \("):
        preflight(config(tmp_path, LONG_TAIL_TASK, "next_digit"))
    with pytest.raises(ConfigError, match=r"rm_type='long_tail' scores the builtin long-tail task, but prompt_data="
                                          r"'builtin:next-digit' .* pass --rm-type next_digit \("):
        preflight(config(tmp_path, "builtin:next-digit", "long_tail"))
    with pytest.raises(ConfigError, match=r"prompt_data='builtin:long-tails': unknown builtin dataset; use one of "
                                          r"'builtin:next-digit', 'builtin:long-tail'"):
        preflight(config(tmp_path, "builtin:long-tails", "long_tail"))
