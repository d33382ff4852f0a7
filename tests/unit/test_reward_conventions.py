"""Reward functions as people write them: TRL's (None = no reward), verl's compute_score, raygym's
own, sync or async; several with weights, each logged; the math-verify built-in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from raygym.errors import ConfigError
from raygym.rewards.scoring import RewardModel, resolve_reward_functions, reward_component_metrics
from raygym.rewards.signatures import missing_inputs, reward_convention, trl_arguments
from raygym.types import Sample

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gsm8k_sample.jsonl"


def gsm8k_group(responses: list[str], row: int = 0) -> list[Sample]:
    data = json.loads(FIXTURE.read_text().splitlines()[row])
    return [Sample(prompt=data["question"], prompt_tokens=[1], group_index=0, sample_index=i, response_text=r,
                   response_tokens=[7] * len(r), label=data["answer"], columns={"answer": data["answer"]})
            for i, r in enumerate(responses)]


def score(model: RewardModel, samples: list[Sample]) -> list[Sample]:
    asyncio.run(model.score(samples))
    return samples


# A TRL reward function as TRL's docs write them: a list in, a list out, dataset columns as kwargs.
CALLS: list[dict] = []


def trl_accuracy(prompts, completions, answer, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
    out = []
    for completion, truth in zip(completions, answer, strict=True):
        if not completion:
            out.append(None)  # TRL: this function has no opinion on this sample
        else:
            out.append(1.0 if completion.strip().endswith(truth.split("####")[-1].strip()) else 0.0)
    return out


def test_trl_function_gets_lists_and_columns_and_none_means_no_reward():
    CALLS.clear()
    model = RewardModel(custom_rm_function=trl_accuracy)
    assert model.convention == "trl" and model.per_group
    out = score(model, gsm8k_group(["so it is 16", "it is 15", ""]))
    assert [s.reward for s in out] == [1.0, 0.0, 0.0]
    assert [s.reward_components["trl_accuracy"] for s in out] == [1.0, 0.0, None]
    assert all(s.reward_error is None for s in out)
    (call,) = CALLS  # one call for the group
    assert call["completions"] == ["so it is 16", "it is 15", ""]
    assert call["completion_ids"] == [[7] * 11, [7] * 8, []]
    assert len(call["prompts"]) == 3 and call["answer"][0].endswith("#### 16")
    metrics = reward_component_metrics(out, model.names, "rollout/")
    assert metrics == {"rollout/reward/trl_accuracy": 0.5, "rollout/reward_none": 1.0}


def test_trl_by_import_path_chat_prompts_and_async():
    model = RewardModel(custom_rm_function="tests.unit.test_reward_conventions:trl_length_async")
    assert model.convention == "trl"
    chat = [{"role": "user", "content": "hi"}]
    samples = [Sample(prompt=chat, prompt_tokens=[1], group_index=0, response_text=t) for t in ("ab", "abcd")]
    assert [s.reward for s in score(model, samples)] == [2.0, 4.0]
    args = trl_arguments(samples)
    assert args["completions"] == [[{"role": "assistant", "content": "ab"}], [{"role": "assistant", "content": "abcd"}]]


async def trl_length_async(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c[0]["content"])) for c in completions]


def test_trl_function_returning_the_wrong_length_is_an_error_on_each_sample():
    def short(completions, **kwargs):
        return [1.0]

    out = score(RewardModel(custom_rm_function=short), gsm8k_group(["a", "b"]))
    assert [s.reward for s in out] == [0.0, 0.0]
    assert all("returned 1 rewards for 2 samples" in s.reward_error for s in out)


def test_signature_recognition_order():
    def raygym_sample(sample):
        return 0.0

    def fields(prompt, response):
        return 0.0

    def batched(samples):
        return []

    def trl(completions, **kwargs):
        return []

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def verl_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return 0.0

    found = [reward_convention(f) for f in (raygym_sample, fields, batched, trl, verl, verl_kwargs)]
    assert found == ["sample", "fields", "batched", "trl", "verl", "verl"]
    with pytest.raises(ConfigError, match=r"unsupported signature two\(a, b\).*TRL's fn\(prompts, completions"):
        reward_convention(two)


def two(a, b):
    return 0.0


def test_trl_missing_inputs_are_the_required_ones_no_column_supplies():
    def needs(prompts, completions, solution, trainer_state, difficulty="easy", **kwargs):
        return []

    assert missing_inputs(needs, "trl", ["answer"]) == ["solution", "trainer_state"]
    assert missing_inputs(needs, "trl", ["solution", "trainer_state"]) == []
    assert missing_inputs(needs, "fields", []) == []


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k" and extra_info == {"split": "train", "index": 3}
    return {"score": 1.0 if solution_str.strip() == str(ground_truth) else -1.0, "acc": 0}


def test_verl_compute_score_reads_the_reward_model_dict_and_columns():
    model = RewardModel(custom_rm_function=verl_compute_score)
    assert model.convention == "verl"
    label = {"style": "rule", "ground_truth": "72"}  # verl data: --label-key reward_model
    samples = [Sample(prompt=[{"role": "user", "content": "q"}], prompt_tokens=[1], group_index=0, response_text=r,
                      label=label, columns={"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 3},
                                            "reward_model": label})
               for r in ("72", "71")]
    out = score(model, samples)
    assert [s.reward for s in out] == [1.0, -1.0] and all(s.reward_error is None for s in out)


def test_per_sample_none_is_an_error_not_a_silent_zero():
    out = score(RewardModel(custom_rm_function=lambda sample: None), gsm8k_group(["x"]))
    assert out[0].reward == 0.0 and "returned None" in out[0].reward_error


def format_bonus(prompt, response):
    return 1.0 if "####" in response else 0.0


def test_weighted_rewards_sum_and_each_is_logged():
    model = RewardModel(reward_functions={"gsm8k": 1.0, "tests.unit.test_reward_conventions:format_bonus": 0.25,
                                          "tests.unit.test_reward_conventions:trl_accuracy": 2.0})
    assert model.names == ["gsm8k", "format_bonus", "trl_accuracy"] and model.per_group
    out = score(model, gsm8k_group(["#### 16", "it is 16", "#### 3", ""]))
    assert [s.reward for s in out] == [1.0 + 0.25 + 2.0, 1.0 + 0.0 + 2.0, 0.0 + 0.25 + 0.0, 0.0]
    assert out[3].reward_components == {"gsm8k": 0.0, "format_bonus": 0.0, "trl_accuracy": None}
    metrics = reward_component_metrics(out, model.names, "rollout/")
    assert metrics["rollout/reward/gsm8k"] == 0.5 and metrics["rollout/reward/format_bonus"] == 0.5
    assert metrics["rollout/reward/trl_accuracy"] == pytest.approx(2 / 3) and metrics["rollout/reward_none"] == 0.0


def test_one_failing_function_of_several_keeps_the_others():
    def broken(sample):
        raise KeyError("x")

    model = RewardModel(reward_functions={"exact": 1.0, "tests.unit.test_reward_conventions:format_bonus": 1.0})
    model.functions.append(resolve_reward_functions(custom_rm_function=broken)[0])
    (s,) = score(model, gsm8k_group(["#### 16"]))
    assert s.reward == 1.0 and s.reward_error == "broken: KeyError: 'x'"


def test_reward_functions_errors():
    with pytest.raises(ConfigError, match=r"reward_functions\['nope.mod:f'\]=.*cannot import"):
        resolve_reward_functions(reward_functions={"nope.mod:f": 1.0})
    with pytest.raises(ConfigError, match="two functions are named 'format_bonus'"):
        resolve_reward_functions(reward_functions={"tests.unit.test_reward_conventions:format_bonus": 1.0,
                                                   "tests.unit.test_reward_conventions.format_bonus": 1.0})
    with pytest.raises(ConfigError, match="rm_type=None and no custom_rm_function.*--rm-type.*'gsm8k'"):
        resolve_reward_functions()


def test_math_verify_builtin():
    pytest.importorskip("math_verify")
    model = RewardModel("math_verify")
    samples = [Sample(prompt="q", prompt_tokens=[1], group_index=0, response_text=r, label=label)
               for r, label in [("so \\boxed{\\frac{1}{2}}", "0.5"), ("it is $x^2+1$", "$1+x^2$"),
                                ("she has 16 apples", "... #### 16"), ("\\boxed{4}", "3")]]
    assert [s.reward for s in score(model, samples)] == [1.0, 1.0, 1.0, 0.0]
    assert all(s.reward_error is None for s in samples)  # ran in the reward threads, without SIGALRM
