"""Built-in verifiers, custom reward conventions, failures recorded (never raised), off-loop execution."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from pathlib import Path

import pytest

from raygym.builtin import next_digit_reward as builtin_next_digit_reward
from raygym.errors import ConfigError
from raygym.rewards.scoring import (
    RewardModel,
    extract_boxed,
    gsm8k_label,
    gsm8k_reward,
    math_reward,
    normalize_answer,
    pass_at_k,
    reward_convention,
)
from raygym.types import Sample

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gsm8k_sample.jsonl"


def sample(response: str = "", label=None, prompt: str = "q", index: int = 0) -> Sample:
    return Sample(
        prompt=prompt,
        prompt_tokens=[1],
        group_index=0,
        sample_index=index,
        response_text=response,
        label=label,
        metadata={"k": index},
    )


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("$18", "18"),
        ("1,000", "1000"),
        (" 12.0 ", "12"),
        ("12.50", "25/2"),
        ("0.5", "1/2"),
        ("2/4", "1/2"),
        ("\\frac{1}{2}", "1/2"),
        ("\\dfrac{3}{4}", "3/4"),
        ("-3", "-3"),
        ("\\text{cats}", "cats"),
        ("5.", "5"),
        ("{42}", "42"),
        ("{{x}+1}", "{x}+1"),
        ("x+1", "x+1"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("\\boxed{\\frac{1}{2}+1}", "\\frac{1}{2} + 1", 1.0),
        ("the total is 1,250 pencils", "1250", 1.0),
        ("it is 7 or 8", "7", 0.0),
        ("no number here", "3", 0.0),
        ("\\boxed{12.0}", "\\boxed{12}", 1.0),
        ("3/6", "1/2", 1.0),
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(response, label) == reward


def test_extract_boxed_unbalanced_is_none():
    assert extract_boxed("\\boxed{1") is None
    assert extract_boxed("nothing") is None


def test_gsm8k_on_fixture_rows():
    rows = [json.loads(line) for line in FIXTURE.open()]
    finals = [gsm8k_label(r["answer"]) for r in rows]
    assert finals == ["16", "360", "16.5", "50", "10", "23"]
    for row, final in zip(rows, finals, strict=True):
        assert gsm8k_reward(f"work...\n#### {final}", row["answer"]) == 1.0
        assert gsm8k_reward(f"so the answer is {final}.", row["answer"]) == 1.0
        assert gsm8k_reward("#### 99999", row["answer"]) == 0.0
    assert gsm8k_reward("it makes $360.00", rows[1]["answer"]) == 1.0
    assert gsm8k_reward("#### 7 then 8", "#### 7") == 1.0  # the marked answer wins over the last number


def test_builtin_types_and_unknown_type():
    assert RewardModel("exact").convention == "sample"
    with pytest.raises(ConfigError, match="rm_type='nope'"):
        RewardModel("nope")
    with pytest.raises(ConfigError, match="rm_type=None"):
        RewardModel(None)


def score(model: RewardModel, samples: list[Sample]) -> list[Sample]:
    asyncio.run(model.score(samples))
    return samples


def test_builtins_score_samples():
    out = score(RewardModel("exact"), [sample(" 4 ", "4"), sample("5", "4")])
    assert [s.reward for s in out] == [1.0, 0.0]
    responses = ["8", "8x", "7", "x"]
    out = score(RewardModel("next_digit"), [sample(r, "8") for r in responses])
    assert [s.reward for s in out] == [builtin_next_digit_reward(r, "8") for r in responses]
    assert out[0].reward == 1.0 and out[3].reward == 0.0


def test_raising_reward_gives_zero_and_records_the_error():
    def flaky(sample: Sample) -> float:
        if sample.sample_index == 1:
            raise KeyError("no verifier for this one")
        return 0.75

    out = score(RewardModel(custom_rm_function=flaky), [sample(index=i) for i in range(3)])
    assert [s.reward for s in out] == [0.75, 0.0, 0.75]
    assert [s.reward_error for s in out] == [None, "KeyError: 'no verifier for this one'", None]


def test_async_fields_style_reward_gets_fields_by_name():
    seen = []

    async def judge(prompt, response, label, metadata):
        await asyncio.sleep(0)
        seen.append((prompt, response, label, metadata))
        return float(response == label)

    assert reward_convention(judge) == "fields"
    out = score(RewardModel(custom_rm_function=judge), [sample("a", "a", "p0", 0), sample("b", "a", "p1", 1)])
    assert [s.reward for s in out] == [1.0, 0.0]
    assert sorted(seen) == [("p0", "a", "a", {"k": 0}), ("p1", "b", "a", {"k": 1})]


def test_fields_style_subset_and_import_path():
    model = RewardModel(custom_rm_function="raygym.rewards.scoring:exact_reward")  # fn(response, label)
    assert model.convention == "fields"
    assert [s.reward for s in score(model, [sample("x", "x"), sample("y", "x")])] == [1.0, 0.0]


def test_batched_by_attribute_and_by_parameter_name():
    calls = []

    def by_attr(batch):
        calls.append(len(batch))
        return [len(s.response_text) for s in batch]

    by_attr.batched = True

    async def by_name(samples):
        calls.append(len(samples))
        return [2.0] * len(samples)

    assert score(RewardModel(custom_rm_function=by_attr), [sample("ab"), sample("abc")])[1].reward == 3.0
    assert [s.reward for s in score(RewardModel(custom_rm_function=by_name), [sample(), sample()])] == [
        2.0,
        2.0,
    ]
    assert calls == [2, 2]  # one call per batch, not per sample


def test_batched_wrong_length_records_error_on_every_sample():
    def short(samples):
        return [1.0]

    out = score(RewardModel(custom_rm_function=short), [sample(), sample()])
    assert [s.reward for s in out] == [0.0, 0.0]
    assert all("returned 1 rewards for 2 samples" in s.reward_error for s in out)


def test_sync_reward_runs_off_the_event_loop():
    # The reward blocks until a coroutine on the loop releases it: on the loop itself this would deadlock.
    released = threading.Event()

    def blocking(sample: Sample) -> float:
        return 1.0 if released.wait(timeout=10) else 0.0

    async def main() -> Sample:
        s = sample()
        task = asyncio.create_task(RewardModel(custom_rm_function=blocking).score([s]))
        await asyncio.sleep(0.05)
        released.set()
        await task
        return s

    assert asyncio.run(main()).reward == 1.0


def test_reward_timeout_is_recorded():
    gate = threading.Event()

    def stuck(sample: Sample) -> float:
        gate.wait(timeout=10)
        return 1.0

    s = score(RewardModel(custom_rm_function=stuck, timeout=0.1), [sample()])[0]
    gate.set()
    assert s.reward == 0.0 and s.reward_error.startswith("TimeoutError")


def test_post_process_returns_or_edits():
    model = RewardModel("exact", post_process_function=lambda samples: [s.reward * 10 for s in samples])
    out = score(model, [sample("a", "a"), sample("b", "a")])
    model.post_process(out)
    assert [s.reward for s in out] == [10.0, 0.0]
    bad = RewardModel("exact", post_process_function=lambda samples: [1.0])
    with pytest.raises(ConfigError, match="returned 1 rewards for 2 samples"):
        bad.post_process(out)


def test_bad_custom_functions_are_config_errors():
    with pytest.raises(ConfigError, match="cannot import"):
        RewardModel(custom_rm_function="raygym.nope:fn")
    with pytest.raises(ConfigError, match="unsupported signature"):
        RewardModel(custom_rm_function=lambda a, b: 0.0)
    with pytest.raises(ConfigError, match="not a callable or an import path"):
        RewardModel(custom_rm_function=42)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 4), (5, 2, 3), (8, 3, 2), (6, 6, 2)])
def test_pass_at_k_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))
