"""Routed experts of MoE generation (routing replay, "R3"): the wire format engines answer in and what a sample
keeps of it. Pure (numpy only).

An engine asked for them (``return_routed_experts: true`` in ``/generate``; SGLang's request field) answers with
``meta_info["routed_experts"]``: base64 of the int32 array ``[tokens - 1, layers, top_k]`` in C order, the experts
each router chose for every token it forwarded (the prompt and every output token but the last, which no forward
pass read). Stock SGLang and raygym's server write exactly this.

A :class:`raygym.types.Sample` keeps one row per forwarded token, each layer's ``top_k`` experts one after the
other (``[tokens - 1, layers * top_k]``, int16): the trainers reshape rows with their model's layer count and
top-k and force those experts in their forward passes (``raygym.trainer.routing_replay``).

>>> ids = np.array([[[0, 3], [1, 2]], [[2, 3], [0, 1]]], dtype=np.int32)   # 3 tokens, 2 layers, top-2
>>> rows = decode(encode(ids), tokens=3)
>>> rows.shape, rows[1].tolist()
((2, 4), [2, 3, 0, 1])
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from raygym.errors import ConfigError, RaygymError

if TYPE_CHECKING:
    from raygym.types import Sample

META_KEY = "routed_experts"  # meta_info key of the answer; also the request flag's suffix (return_routed_experts)
REQUEST_FIELD = "return_routed_experts"
SERVER_FLAG = "--enable-return-routed-experts"  # SGLang's and raygym's server flag that turns capture on
WIRE_DTYPE = np.int32
SAMPLE_DTYPE = np.int16


def encode(ids: np.ndarray) -> str:
    """The wire form of ``ids`` (``[tokens - 1, layers, top_k]`` or any shape; int32 bytes, C order)."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype=WIRE_DTYPE).tobytes()).decode("ascii")


def decode(text: str, tokens: int) -> np.ndarray:
    """The ``[tokens - 1, layers * top_k]`` rows of an answer's ``routed_experts`` for a sequence of ``tokens``
    tokens (prompt and output). ValueError when the size does not split into ``tokens - 1`` rows."""
    flat = np.frombuffer(base64.b64decode(text), dtype=WIRE_DTYPE)
    rows = max(tokens - 1, 0)
    if rows == 0 or flat.size % rows or flat.size == 0:
        raise ValueError(f"routed_experts holds {flat.size} ids, which is not a positive multiple of the "
                         f"{rows} forwarded tokens of a {tokens}-token sequence")
    return flat.reshape(rows, -1).astype(SAMPLE_DTYPE)


def from_answer(meta: dict[str, Any], tokens: int) -> np.ndarray | None:
    """The routed experts of one ``/generate`` answer (``meta_info``) for a ``tokens``-token sequence, or None
    when the answer has none."""
    text = meta.get(META_KEY)
    if not isinstance(text, str) or not text:
        return None
    return decode(text, tokens)


def extend(before: np.ndarray | None, after: np.ndarray | None) -> np.ndarray | None:
    """A continued response's routing (a partial rollout continued on new weights): the rows of the first part
    as they were, then the continuation's rows from where the first part ended. The continuation's prefill
    forwarded the earlier tokens again (on the new weights), so its answer covers every row; the first part's
    are the ones its tokens were generated with.

    >>> first, again = np.zeros((3, 2), np.int16), np.ones((5, 2), np.int16)
    >>> extend(first, again)[:, 0].tolist()
    [0, 0, 0, 1, 1]
    """
    if before is None or after is None:
        return after if before is None else None
    return np.concatenate([before, after[len(before):]])


def require_moe(hf_config: dict[str, Any], model_path: str) -> None:
    """ConfigError unless the checkpoint config ``hf_config`` (of ``model_path``) is a mixture of experts: routing
    replay has nothing to replay in a dense model.

    >>> require_moe({"num_experts": 8, "num_experts_per_tok": 2}, "m")
    >>> require_moe({"num_hidden_layers": 2}, "dense")
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: use_rollout_routing_replay=True: the model at dense has no experts (no num_experts in its config.json); routing replay is for mixture-of-experts models (e.g. builtin:tiny-qwen3-moe); drop --use-rollout-routing-replay
    """
    if not (hf_config.get("num_experts") or hf_config.get("num_local_experts")):
        raise ConfigError(f"use_rollout_routing_replay=True: the model at {model_path} has no experts (no num_experts "
                          "in its config.json); routing replay is for mixture-of-experts models (e.g. "
                          "builtin:tiny-qwen3-moe); drop --use-rollout-routing-replay")


def request_fields(replay: bool) -> dict[str, Any]:
    """What every rollout ``/generate`` request carries for routing replay (``use_rollout_routing_replay``)."""
    return {REQUEST_FIELD: True} if replay else {}


def read_into(sample: Sample, meta: Any, *, extending: bool) -> None:
    """Keep the routed experts of an answer (``meta_info``) for ``sample``, whose tokens are already read (all
    of them, the continuation's too when ``extending``). RaygymError when an answer that was asked for them
    has none (an engine that was not started to capture them); an aborted answer may have none."""
    routes = from_answer(meta, len(sample.prompt_tokens) + sample.response_length)
    if routes is None:
        reason = meta.get("finish_reason")  # a dict, or the engine protocol's answer model (which has .get too)
        if reason is not None and reason.get("type") == "abort":
            return
        raise RaygymError(f"engine {sample.engine or '?'} answered without routed_experts although the request asked "
                          f"for them ({REQUEST_FIELD}); was it started with {SERVER_FLAG}?")
    sample.routed_experts = extend(sample.routed_experts, routes) if extending else routes
