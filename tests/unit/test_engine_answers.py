"""The answer models read what stock SGLang writes, including its shortest answers: a request it aborted (a
``pause_generation`` in abort mode, or one aborted in its waiting queue) carries ``id``, ``finish_reason``,
``weight_version``, ``e2e_latency``, ``completion_tokens`` and the log-probs asked for, but no ``prompt_tokens``
(``TokenizerManager._handle_abort_req``, SGLang 0.5.18)."""

from __future__ import annotations

from raygym.engine_api.protocol import GenerateResponse


def test_sglangs_answer_to_an_aborted_request_is_read():
    answer = GenerateResponse.model_validate({
        "text": "12", "output_ids": [5, 6],
        "meta_info": {"id": "adc45ba5", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                      "weight_version": 3, "e2e_latency": 0.25, "completion_tokens": 2,
                      "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}})
    assert answer.finish_type == "abort" and answer.meta_info.weight_version == "3"
    assert answer.tokens_and_logprobs() == ([5, 6], [-0.5, -1.5])
    assert answer.meta_info.prompt_tokens == 0 and answer.meta_info.completion_tokens == 2
