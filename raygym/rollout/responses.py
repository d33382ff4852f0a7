"""Engine answers read into samples, pure: per-token weight versions, finish reasons, the per-request
sampling seeds, and the continuation of a response an engine aborted for a weight update (partial rollouts)."""

from __future__ import annotations

import hashlib
from typing import Any

from raygym.engine_api.protocol import GenerateMetaInfo
from raygym.types import Sample

MAX_CONTINUATIONS = 8  # continuations of one aborted response before it is given up (status "aborted")


def image_fields(samples: list[Sample]) -> dict[str, Any]:
    """``/generate`` fields that carry these samples' images (SGLang's ``image_data``, one list per prompt of a
    batched request); none when no sample has an image.

    >>> image_fields([Sample(prompt="", prompt_tokens=[1], group_index=0)])
    {}
    >>> image_fields([Sample(prompt="", prompt_tokens=[1], group_index=0, images=["data:image/png;base64,AA=="])])
    {'image_data': [['data:image/png;base64,AA==']]}
    """
    if not any(s.images for s in samples):
        return {}
    return {"image_data": [list(s.images) for s in samples]}


def derive_sampling_seed(seed: int, *key: Any) -> int:
    """A per-request ``sampling_seed`` from the run seed and the request's place in the run.

    ``key`` is e.g. ``("rollout", rollout_id, group, sample)``: the same request gets the same seed
    whatever the batch composition, routing or timing, so a resumed run samples what an
    uninterrupted one did.

    >>> derive_sampling_seed(1234, "rollout", 3, 0, 1) == derive_sampling_seed(1234, "rollout", 3, 0, 1)
    True
    >>> derive_sampling_seed(1234, "rollout", 3, 0, 1) != derive_sampling_seed(1234, "rollout", 3, 0, 2)
    True
    """
    digest = hashlib.blake2b(repr((int(seed), *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def token_versions(meta: GenerateMetaInfo, count: int, default: int) -> list[int]:
    """The policy version of each of ``count`` output tokens: raygym's server reports one per token
    (``output_token_weight_versions``); other engines one per answer (``weight_version``).

    >>> meta = {"id": "r", "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 2, "weight_version": "3"}
    >>> token_versions(GenerateMetaInfo.model_validate(meta), 2, 0)
    [3, 3]
    >>> token_versions(GenerateMetaInfo.model_validate({**meta, "output_token_weight_versions": ["3", "4"]}), 2, 0)
    [3, 4]
    """
    per_token = meta.output_token_weight_versions
    if per_token is not None and len(per_token) == count:
        try:
            return [int(v) for v in per_token]
        except (TypeError, ValueError):
            pass
    return [weight_version_of(meta, default)] * count


def continuation_budget(sample: Sample, params: dict[str, Any]) -> int:
    """New tokens the continuation of an aborted ``sample`` may still generate."""
    return int(params.get("max_new_tokens", 0)) - sample.response_length


def continuation_params(sample: Sample, params: dict[str, Any], segment: int) -> dict[str, Any]:
    """``params`` for the ``segment``-th continuation of ``sample``: the tokens left, a seed of its own."""
    out = {**params, "max_new_tokens": continuation_budget(sample, params)}
    if "sampling_seed" in params:
        out["sampling_seed"] = derive_sampling_seed(int(params["sampling_seed"]), "continuation", segment)
    return out


def weight_version_of(meta: GenerateMetaInfo, default: int) -> int:
    """The answer's ``weight_version`` as a policy version (``default`` when it is not a number)."""
    try:
        return int(meta.weight_version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
