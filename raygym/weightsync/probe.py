"""Verifying weights an engine will not checksum: a probe of log-probs (pure; no torch, no ray).

After a sync, every engine generates a few tokens from fixed prompts with a fixed seed and reports the
log-prob of each sampled token; the trainer scores the same tokens with its own forward pass. An engine
whose weights are not the trainer's (a tensor dropped, a bucket misapplied, a stale version) disagrees by
far more than the numerical noise between the two (bf16 kernels on the engine, fp32 on a CPU trainer).

>>> p = ProbeSpec()
>>> request = p.generate_request(temperature=1.0)
>>> request.input_ids[0][:4], request.sampling_params[0]["max_new_tokens"]
([1, 2, 3, 4], 8)
>>> compare_logprobs([[-1.0, -2.0]], [[-1.01, -2.03]], tolerance=0.05)
ProbeResult(tokens=2, mean_abs_diff=0.02, max_abs_diff=0.03, ok=True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raygym.engine_protocol import GenerateRequest


@dataclass(frozen=True)
class ProbeSpec:
    """Fixed prompts (token ids small enough for any vocabulary) and how much to generate."""

    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5, 6, 7, 8), (9, 10, 11, 12, 13, 14, 15, 3))
    new_tokens: int = 8
    seed: int = 20240601

    def generate_request(self, temperature: float, lora_path: str | None = None) -> GenerateRequest:
        """The ``/generate`` request: one seeded sample per prompt, unfiltered, with output log-probs (``lora_path``:
        generated with that loaded adapter)."""
        params = [{"max_new_tokens": self.new_tokens, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                   "ignore_eos": True, "sampling_seed": self.seed + i} for i in range(len(self.prompts))]
        return GenerateRequest(input_ids=[list(p) for p in self.prompts], sampling_params=params, return_logprob=True,
                               lora_path=lora_path)


@dataclass(frozen=True)
class EngineProbe:
    """What one engine generated for the probe: per prompt, its tokens and their log-probs."""

    responses: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)

    @classmethod
    def from_answer(cls, answer: Any) -> EngineProbe:
        """Read the answer to :meth:`ProbeSpec.generate_request` (a list of
        :class:`~raygym.engine_protocol.GenerateResponse`, one per prompt)."""
        if not isinstance(answer, list):
            raise ValueError(f"probe: expected a list of answers, got {type(answer).__name__}")
        responses, logprobs = [], []
        for item in answer:
            if not item.meta_info.output_token_logprobs:
                raise ValueError("probe: an answer carries no output_token_logprobs")
            tokens, values = item.tokens_and_logprobs()
            responses.append(tokens)
            logprobs.append(values)
        return cls(responses, logprobs)


@dataclass(frozen=True)
class ProbeResult:
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    ok: bool


def compare_logprobs(engine: list[list[float]], trainer: list[list[float]], tolerance: float) -> ProbeResult:
    """Mean and max absolute difference over every token; ``ok`` when the mean is within ``tolerance``."""
    diffs: list[float] = []
    for e_row, t_row in zip(engine, trainer, strict=True):
        if len(e_row) != len(t_row):
            raise ValueError(f"probe: {len(e_row)} engine log-probs vs {len(t_row)} from the trainer")
        diffs.extend(abs(a - b) for a, b in zip(e_row, t_row, strict=True))
    if not diffs:
        return ProbeResult(0, 0.0, 0.0, False)
    mean = round(sum(diffs) / len(diffs), 6)
    return ProbeResult(len(diffs), mean, round(max(diffs), 6), mean <= tolerance)
