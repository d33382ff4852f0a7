"""Routed experts of MoE generation (raygym.routed_experts): SGLang's wire form, what a sample keeps of an answer,
the continuation of a response across a weight update, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raygym.errors import ConfigError, RaygymError
from raygym.routed_experts import (
    REQUEST_FIELD,
    decode,
    encode,
    from_answer,
    read_into,
    request_fields,
    require_moe,
)
from raygym.trainer.batch import TrainBatch
from raygym.types import Sample


def answer(ids: np.ndarray, finish: str = "length") -> dict:
    return {"routed_experts": encode(ids), "finish_reason": {"type": finish}}


def test_round_trip_is_sglangs_int32_c_order():
    ids = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)  # 6 tokens, 3 layers, top-2
    import base64

    assert base64.b64decode(encode(ids)) == ids.tobytes()  # what SGLang's detokenizer writes
    rows = decode(encode(ids), tokens=6)
    assert rows.dtype == np.int16 and rows.shape == (5, 6) and rows.tolist() == ids.reshape(5, 6).tolist()


def test_sizes_that_do_not_fit_the_sequence_are_refused():
    with pytest.raises(ValueError, match="not a positive multiple"):
        decode(encode(np.zeros((4, 2, 2), np.int32)), tokens=4)  # 16 ids for 3 forwarded tokens
    assert from_answer({"finish_reason": {"type": "stop"}}, 4) is None


def test_a_sample_keeps_one_row_per_forwarded_token_and_continuations_extend_it():
    s = Sample(prompt="p", prompt_tokens=[1, 2, 3], group_index=0, response_tokens=[4, 5])
    read_into(s, answer(np.full((4, 2, 2), 7, np.int32)), extending=False)
    assert s.routed_experts is not None and s.routed_experts.shape == (4, 4)
    s.response_tokens += [6, 7, 8]  # a continuation on new weights: its answer covers all 7 forwarded tokens
    read_into(s, answer(np.full((7, 2, 2), 9, np.int32)), extending=True)
    assert s.routed_experts[:, 0].tolist() == [7, 7, 7, 7, 9, 9, 9]


def test_an_answer_without_routes_is_an_error_unless_aborted():
    s = Sample(prompt="p", prompt_tokens=[1, 2], group_index=0, response_tokens=[3], engine="engine-0")
    read_into(s, {"finish_reason": {"type": "abort"}}, extending=False)
    assert s.routed_experts is None
    with pytest.raises(RaygymError, match="engine-0 answered without routed_experts"):
        read_into(s, {"finish_reason": {"type": "stop"}}, extending=False)


def test_request_fields_and_dense_models():
    assert request_fields(True) == {REQUEST_FIELD: True} and request_fields(False) == {}
    with pytest.raises(ConfigError, match="no experts"):
        require_moe({"num_hidden_layers": 2}, "/m")
    require_moe({"num_local_experts": 8}, "/m")  # transformers 5's name


def test_train_batch_carries_routes_flat_and_keeps_them_through_select():
    a = Sample(prompt="p", prompt_tokens=[1, 2], group_index=0, response_tokens=[3, 4], rollout_log_probs=[0.0, 0.0],
               routed_experts=np.arange(12, dtype=np.int16).reshape(3, 4))
    b = Sample(prompt="p", prompt_tokens=[1], group_index=0, response_tokens=[2], rollout_log_probs=[0.0])
    batch = TrainBatch.from_samples([a, b])
    assert batch.routed_experts is not None
    assert batch.routed_experts[0].dtype == torch.int16 and batch.routed_experts[0].tolist() == list(range(12))
    assert batch.routed_experts[1].numel() == 0  # no routes: its routers choose
    assert batch.select([1, 0]).routed_experts[1].tolist() == list(range(12))
    assert TrainBatch.from_samples([b]).routed_experts is None
