"""The probe's pure parts: its request, how an answer is read, and the tolerances calibrated from a floor."""

from __future__ import annotations

import pytest

from raygym.engine_api.protocol import GenerateResponse
from raygym.weightsync.probe import (
    MIN_MAX,
    MIN_MEAN,
    EngineProbe,
    ProbeCalibration,
    ProbeSpec,
    compare_logprobs,
)


def answer(prompt: list[int], tokens: list[int], prompt_lps: list[float] | None) -> GenerateResponse:
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
            "output_token_logprobs": [[-0.5, t, None] for t in tokens]}
    if prompt_lps is not None:
        meta["input_token_logprobs"] = [[None, prompt[0], None]] + [[lp, t, None] for lp, t in zip(prompt_lps, prompt[1:], strict=True)]
    return GenerateResponse.model_validate({"text": "", "output_ids": tokens, "meta_info": meta})


def test_teacher_forced_only_at_temperature_one():
    spec = ProbeSpec()
    forced = spec.generate_request(1.0)
    assert forced.logprob_start_len == 0 and len(forced.input_ids) == len(spec.prompts) + spec.scored
    assert all(len(s) == spec.scored_len and all(2 <= t < 48 for t in s) for s in spec.sequences())
    sampled = spec.generate_request(0.7)
    assert sampled.logprob_start_len is None and len(sampled.input_ids) == len(spec.prompts)


def test_an_answer_is_scored_from_the_first_prompt_token_when_forced():
    spec = ProbeSpec(prompts=((1, 2, 3),), scored=1, scored_len=4)
    request = spec.generate_request(1.0)
    seq = request.input_ids[1]
    probe = EngineProbe.from_answer([answer([1, 2, 3], [7, 8], [-1.0, -2.0]),
                                     answer(seq, [9], [-0.1, -0.2, -0.3])], request)
    assert probe.prefixes == [[1], seq[:1]]
    assert probe.responses == [[2, 3, 7, 8], seq[1:] + [9]]
    assert probe.logprobs == [[-1.0, -2.0, -0.5, -0.5], [-0.1, -0.2, -0.3, -0.5]]
    with pytest.raises(ValueError, match="prompt log-probs"):
        EngineProbe.from_answer([answer([1, 2, 3], [7], None), answer(seq, [9], None)], request)


def test_sampled_only_answers_keep_the_prompt_as_prefix():
    spec = ProbeSpec(prompts=((1, 2, 3),), scored=0)
    request = spec.generate_request(1.0)
    probe = EngineProbe.from_answer([answer([1, 2, 3], [7, 8], None)], request)
    assert (probe.prefixes, probe.responses, probe.logprobs) == ([[1, 2, 3]], [[7, 8]], [[-0.5, -0.5]])


def test_calibration_judges_the_mean_and_the_worst_token():
    cal = ProbeCalibration.measure(floor_mean=1e-3, floor_max=5e-3, cap=0.1)
    two_tokens_off = compare_logprobs([[-1.0] * 100], [[-1.0] * 98 + [-1.1] * 2], tolerance=cal.tolerance)
    assert two_tokens_off.mean_abs_diff < cal.tolerance and not cal.judge(two_tokens_off).ok
    one_token_off = compare_logprobs([[-1.0] * 100], [[-1.0] * 99 + [-1.1]], tolerance=cal.tolerance)
    assert cal.judge(one_token_off).ok and one_token_off.max_abs_diff > cal.max_tolerance  # 1 in 64 left out
    everywhere = compare_logprobs([[-1.0] * 100], [[-1.005] * 100], tolerance=cal.tolerance)
    assert everywhere.max_abs_diff < cal.max_tolerance and not cal.judge(everywhere).ok
    assert cal.judge(compare_logprobs([[-1.0] * 100], [[-1.001] * 100], tolerance=1.0)).ok


def test_calibration_minimums_and_the_users_cap():
    exact = ProbeCalibration.measure(floor_mean=0.0, floor_max=0.0, cap=0.1)
    assert (exact.tolerance, exact.max_tolerance) == (MIN_MEAN, MIN_MAX)
    assert ProbeCalibration.measure(floor_mean=0.5, floor_max=1.0, cap=0.1).tolerance == 0.1
    assert not ProbeCalibration.measure(0.0, 0.0, cap=0.1).judge(compare_logprobs([], [], 1.0)).ok
