"""The builtin ``long-tail`` task: its rows (seeded, one long row in eight), its reward (``long_tail``), its
data path (``builtin:long-tail`` through the tokenizer and the dataset loader) and the start-up checks that
keep each builtin task's reward on its own data."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from raygym import DatasetConfig, ModelConfig, TrainConfig
from raygym.builtin import (
    LONG_EVERY,
    LONG_REPEATS,
    LONG_TAIL_TASK,
    NEXT_DIGIT_ROWS,
    SHORT_REPEATS,
    TINY_ARCH,
    build_tokenizer,
    long_tail_reward,
    long_tail_rows,
    materialize_dataset,
)
from raygym.data.prompts import PromptDataset
from raygym.errors import ConfigError
from raygym.presets import tiny
from raygym.rewards.scoring import RewardModel, default_rm_type
from raygym.run.preflight import preflight
from raygym.types import Sample


def is_long(row: dict) -> bool:
    return row["prompt"].startswith("long:")


def test_rows_are_seeded_one_in_eight_long_rows_and_well_formed():
    rows = long_tail_rows(NEXT_DIGIT_ROWS, seed=0)
    assert rows == long_tail_rows(NEXT_DIGIT_ROWS, seed=0) and rows != long_tail_rows(NEXT_DIGIT_ROWS, seed=1)
    long_rows = [r for r in rows if is_long(r)]
    assert len(rows) == 1024 and len(long_rows) == 1024 // LONG_EVERY == 128
    for row in rows:
        verb, rest = row["prompt"].split(":")
        digit, count = rest.removesuffix("=").split("x")
        assert row["label"] == digit * int(count) and len(digit) == 1 and digit.isdigit()
        low, high = LONG_REPEATS if verb == "long" else SHORT_REPEATS
        assert verb in ("rep", "long") and low <= int(count) <= high
    assert {len(r["label"]) for r in rows if not is_long(r)} == {1, 2, 3}
    lengths = [len(r["label"]) for r in long_rows]
    assert min(lengths) < 36 and max(lengths) > 52  # the long counts spread over 32-56
    assert {r["label"][0] for r in long_rows} == set("0123456789")
    # the long rows are spread through the data, not bunched at one end
    positions = [i for i, r in enumerate(rows) if is_long(r)]
    assert positions[0] < 64 and positions[-1] > 960


@pytest.mark.parametrize(
    "response, label, reward",
    [("7", "7", 1.0), (" 777\n", "777", 1.0), ("4" * 45, "4" * 45, 1.0),  # exactly right, stripped
     ("3", "7", 0.75),                          # a digit, the right length, the wrong digit: 0.25 + 0.5
     ("x", "7", 0.5),                           # only the length: 0.5
     ("77", "7", 0.5),                          # twice the length: no length score
     ("7777", "777", 0.25 + 0.25 + 0.5 * 2 / 3),  # one too many: the runs are capped at the label
     ("77", "777", 0.25 * 2 / 3 * 2 + 0.5 * 2 / 3),
     ("4" * 30, "4" * 40, 0.75),                # three quarters of everything
     ("44x4", "4444", 0.25 * 2 / 4 * 2 + 0.5),  # the runs stop at the first other character
     ("4" * 64, "4" * 40, 0.5 + 0.5 * (1 - 24 / 40)),  # ran on to the cap
     ("", "444", 0.0), (" ", "4", 0.0)],
)  # fmt: skip
def test_reward_by_hand(response, label, reward):
    assert long_tail_reward(response, label) == pytest.approx(reward)


def test_reward_is_one_only_for_the_answer_and_prefers_a_long_run_on_long_rows():
    label = "5" * 44
    near = ["5" * 43, "5" * 45, "5" * 43 + "6", "6" + "5" * 43, "5" * 22 + " " + "5" * 21]
    assert long_tail_reward(label, label) == 1.0 and all(long_tail_reward(r, label) < 1.0 for r in near)
    # what keeps the tail: on a long row a longer run of the digit always scores more, up to the label
    scores = [long_tail_reward("5" * k, label) for k in range(1, 45)]
    assert scores == sorted(scores) and len(set(scores)) == len(scores)
    # and on a short row, stopping scores more than running on
    assert long_tail_reward("55", "55") > long_tail_reward("555", "55") > long_tail_reward("5" * 10, "55")


def test_rm_type_long_tail_scores_samples_and_is_the_default_of_the_task():
    def sample(response: str, label: str) -> Sample:
        return Sample(prompt="p", prompt_tokens=[1], group_index=0, sample_index=0, response_text=response,
                      label=label)

    samples = [sample("9", "9"), sample("22", "2222"), sample("nope", "2222")]
    asyncio.run(RewardModel("long_tail").score(samples))
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.5, 0.5])
    assert default_rm_type(tiny().replace(rm_type=None), LONG_TAIL_TASK) == "long_tail"


def test_materialised_rows_load_and_fit_the_tiny_model(tmp_path):
    path = materialize_dataset(LONG_TAIL_TASK, tmp_path, seed=0)
    assert Path(path).name == "long-tail-seed0-n1024.jsonl"
    assert [json.loads(line) for line in Path(path).read_text().splitlines()] == long_tail_rows(1024, 0)
    tok = build_tokenizer()
    ds = PromptDataset.from_url(LONG_TAIL_TASK, tok, cache_dir=str(tmp_path / "cache"), shuffle=False)
    rows = ds.next_batch(len(ds))
    assert len(rows) == 1024 and sum(r.prompt.startswith("long:") for r in rows) == 128
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
