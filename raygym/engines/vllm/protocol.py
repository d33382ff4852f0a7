"""SGLang's ``/generate`` in vLLM's terms and back (pure: no vLLM, no torch).

raygym's adapter for vLLM (:mod:`raygym.engines.vllm.server`) receives the engine protocol's requests
(:mod:`raygym.engine_api.protocol`, read and answered by :mod:`raygym.engines.serving.generate_route` as on raygym's own
server) and runs them on vLLM's engine; this module holds the translations, so they are tested without vLLM
installed:

- :func:`sampling_kwargs`: an SGLang ``sampling_params`` dict -> keyword arguments of
  ``vllm.SamplingParams`` (and how many samples, SGLang's ``n``, to run as separate requests);
- :func:`finish_reason`: vLLM's ``finish_reason``/``stop_reason`` -> SGLang's ``finish_reason`` object.

Log-probs: the adapter runs vLLM with ``logprobs_mode="processed_logprobs"``, i.e. ``log_softmax(logits /
temperature)`` of the sampled token (raw logits at temperature 0): what raygym's trainer reproduces. With
top-p/top-k filtering on, vLLM's processed log-probs are those of the filtered distribution (the trainer's
are not); RL recipes sample with top_p=1 and no top-k, where both agree.

>>> kwargs, n = sampling_kwargs({"max_new_tokens": 8, "top_k": -1, "sampling_seed": 7, "no_stop_trim": True})
>>> kwargs["max_tokens"], kwargs["top_k"], kwargs["seed"], kwargs["include_stop_str_in_output"], n
(8, 0, 7, True, 1)
>>> finish_reason("stop", None, eos_token_id=1, completion_tokens=3)
{'type': 'stop', 'matched': 1}
"""

from __future__ import annotations

from typing import Any

# SGLang name -> vLLM name, for fields that pass through with the same meaning.
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
_FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_INTS = ("top_k", "max_new_tokens", "min_new_tokens", "n", "sampling_seed")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
# Accepted at any value: they only shape how SGLang streams output, never what is generated.
_IGNORED = ("stream_interval",)
_KNOWN = (*_FLOATS, *_INTS, *_BOOLS, "stop", "stop_token_ids", "logit_bias", *_IGNORED)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def sampling_kwargs(raw: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
    """``(kwargs for vllm.SamplingParams, n)`` from SGLang's ``sampling_params``; ValueError names a bad field.

    ``n`` > 1 becomes ``n`` separate vLLM requests (SGLang answers one output per sample). Unknown fields are
    errors: a silently ignored sampling setting would make rollouts differ from what the user asked for.

    >>> sampling_kwargs({"temperature": 0})[0]["temperature"]
    0.0
    >>> sampling_kwargs({"regex": "a+"})
    Traceback (most recent call last):
    ...
    ValueError: sampling_params.regex: not supported by raygym's vLLM adapter; supported: ['frequency_penalty', 'ignore_eos', 'logit_bias', 'max_new_tokens', 'min_new_tokens', 'min_p', 'n', 'no_stop_trim', 'presence_penalty', 'repetition_penalty', 'sampling_seed', 'skip_special_tokens', 'spaces_between_special_tokens', 'stop', 'stop_token_ids', 'stream_interval', 'temperature', 'top_k', 'top_p']
    """
    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_NEW_TOKENS}
    n = 1
    for key, value in (raw or {}).items():
        if value is None or key in _IGNORED:
            continue
        name = _RENAMED.get(key, key)
        if key in _FLOATS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"sampling_params.{key}={value!r}: must be a number")
            kwargs[name] = float(value)
        elif key in _INTS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sampling_params.{key}={value!r}: must be an integer")
            if key == "n":
                n = value
            else:
                kwargs[name] = value
        elif key in _BOOLS:
            if not isinstance(value, bool):
                raise ValueError(f"sampling_params.{key}={value!r}: must be true or false")
            kwargs[name] = value
        elif key == "stop":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
                raise ValueError(f"sampling_params.stop={value!r}: must be a non-empty string or a list of them")
            if items:
                kwargs["stop"] = list(items)
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise ValueError(f"sampling_params.stop_token_ids={value!r}: must be a list of token ids")
            if value:
                kwargs["stop_token_ids"] = list(value)
        elif key == "logit_bias":
            if not isinstance(value, dict):
                raise ValueError(f"sampling_params.logit_bias={value!r}: must be an object of token id -> bias")
            if value:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in value.items()}
        else:
            raise ValueError(f"sampling_params.{key}: not supported by raygym's vLLM adapter; "
                             f"supported: {sorted(_KNOWN)}")
    _check(kwargs, n)
    if kwargs.get("top_k", 0) < 0:
        kwargs["top_k"] = 0  # SGLang's -1 ("off") is vLLM's 0
    return kwargs, n


def _check(kwargs: dict[str, Any], n: int) -> None:
    if kwargs.get("temperature", 1.0) < 0:
        raise ValueError(f"sampling_params.temperature={kwargs['temperature']}: must be >= 0 (0 = greedy)")
    if not 0.0 < kwargs.get("top_p", 1.0) <= 1.0:
        raise ValueError(f"sampling_params.top_p={kwargs['top_p']}: must be in (0, 1]")
    if kwargs.get("top_k", -1) < -1:
        raise ValueError(f"sampling_params.top_k={kwargs['top_k']}: must be -1 (off) or >= 1")
    if kwargs["max_tokens"] < 0:
        raise ValueError(f"sampling_params.max_new_tokens={kwargs['max_tokens']}: must be >= 0")
    if n < 1:
        raise ValueError(f"sampling_params.n={n}: must be >= 1")


def finish_reason(reason: str | None, stop_reason: int | str | None, *, eos_token_id: int | None,
                  completion_tokens: int, message: str = "") -> dict[str, Any]:
    """SGLang's ``finish_reason`` from vLLM's ``finish_reason`` and ``stop_reason``.

    vLLM reports ``stop`` with ``stop_reason`` None when the EOS token ended the sample (SGLang names the
    token in ``matched``), the token id for a stop token, the string for a stop string.

    >>> finish_reason("length", None, eos_token_id=1, completion_tokens=8)
    {'type': 'length', 'length': 8}
    >>> finish_reason("stop", "\\n", eos_token_id=1, completion_tokens=2)
    {'type': 'stop', 'matched': '\\n'}
    >>> finish_reason("abort", None, eos_token_id=1, completion_tokens=0, message="paused")
    {'type': 'abort', 'message': 'paused'}
    """
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": eos_token_id if stop_reason is None else stop_reason}
    return {"type": "abort", "message": message or f"finished without a result ({reason})"}
