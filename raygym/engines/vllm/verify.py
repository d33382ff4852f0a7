"""``/raygym/weights_checksum`` on raygym's vLLM adapter: the checksums of what vLLM's workers loaded.

Each worker keeps the xxh3 checksum of every HF-named full tensor its weight updates handed to the model's
``load_weights`` (:meth:`raygym.engines.vllm.weights.RaygymWorkerExtension.raygym_received_checksums`); the
adapter asks every worker and answers one set, so raygym's sync coordinator compares them exactly with the
sender's, as on raygym's own server. These are checksums of the tensors as received and loaded, not of
vLLM's parameters (fused, TP-sharded and, on CPU, repacked): what loading does with them is verified by the
log-prob probe.
"""

from __future__ import annotations

from typing import Any

DIFFERENT_ON_RANKS = "ranks-differ"


def merge_ranks(per_rank: list[dict[str, str]]) -> dict[str, str]:
    """One checksum per name from every TP rank's (each rank receives the full tensors): a name some rank
    lacks is left out, a name the ranks disagree on reads :data:`DIFFERENT_ON_RANKS`, which no sender's
    checksum equals.

    >>> merge_ranks([{"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9"}])
    {'a': '1', 'b': 'ranks-differ'}
    >>> merge_ranks([])
    {}
    """
    if not per_rank:
        return {}
    merged = {}
    for name, digest in per_rank[0].items():
        others = [rank.get(name) for rank in per_rank[1:]]
        if any(other is None for other in others):
            continue
        merged[name] = digest if all(other == digest for other in others) else DIFFERENT_ON_RANKS
    return merged


async def received_checksums(llm: Any, names: list[str] | None, weight_version: str) -> dict[str, Any]:
    """The ``WeightsChecksumResponse`` body: every worker's checksums of ``names`` (None: all it loaded)."""
    per_rank = await llm.collective_rpc("raygym_received_checksums", args=(names,))
    return {"weight_version": weight_version, "checksums": merge_ranks(list(per_rank))}
