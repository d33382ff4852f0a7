"""Per-request sampling for raygym's server: SGLang's ``sampling_params`` (validated) and the sampler.

Log-probabilities: for every sampled token the sampler reports ``log_softmax(logits / temperature)`` at
that token (plain ``log_softmax(logits)`` when temperature is 0). Top-p / top-k filtering only shapes the
sampling distribution, it is NOT applied to the reported log-probs: this is what the trainer reproduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_SEED = 2**63  # torch.Generator seeds are unsigned 64-bit; raygym keeps to the signed range


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang's ``sampling_params`` subset).

    ``temperature`` 0 means greedy; ``top_k`` -1 (or 0) means no top-k; ``max_new_tokens`` counts
    generated tokens. ``stop`` strings need a tokenizer on the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted (slime always sends false); decoding ignores it
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Validate a JSON ``sampling_params`` dict; raises ``ValueError`` naming the bad field.

        Unknown keys that SGLang accepts but raygym ignores (e.g. ``min_p``,
        ``frequency_penalty`` at their neutral values) are tolerated; anything else is an error.
        """
        raw = dict(raw or {})
        p = cls()
        for key, value in raw.items():
            if value is None:
                continue
            if key in ("temperature", "top_p"):
                setattr(p, key, _number(key, value))
            elif key in ("top_k", "max_new_tokens", "n", "sampling_seed"):
                setattr(p, key, _integer(key, value))
            elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
                if not isinstance(value, bool):
                    raise ValueError(f"sampling_params.{key}={value!r}: must be true or false")
                setattr(p, key, value)
            elif key == "stop_token_ids":
                p.stop_token_ids = [_integer(key, v) for v in _as_list(key, value)]
            elif key == "stop":
                items = [value] if isinstance(value, str) else _as_list(key, value)
                if not all(isinstance(s, str) and s for s in items):
                    raise ValueError(
                        f"sampling_params.stop={value!r}: must be a non-empty string or list of them"
                    )
                p.stop = list(items)
            elif key in _IGNORED_KEYS:
                continue
            elif key in _NEUTRAL_KEYS:
                if value != _NEUTRAL_KEYS[key]:
                    raise ValueError(
                        f"sampling_params.{key}={value!r}: not supported by raygym's server; "
                        f"leave it at {_NEUTRAL_KEYS[key]!r} or use the sglang backend"
                    )
            else:
                raise ValueError(f"sampling_params.{key}: unknown field; supported: {sorted(_KNOWN_KEYS)}")
        p.validate()
        return p

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"sampling_params.temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"sampling_params.top_k={self.top_k}: must be -1 (off) or >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.n < 1:
            raise ValueError(f"sampling_params.n={self.n}: must be >= 1")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < MAX_SEED:
            raise ValueError(f"sampling_params.sampling_seed={self.sampling_seed}: must be in [0, 2**63)")
        if any(not 0 <= t < 2**62 for t in self.stop_token_ids):
            raise ValueError(f"sampling_params.stop_token_ids={self.stop_token_ids}: token ids are >= 0")


_NEUTRAL_KEYS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": {},
    "stop_regex": [],
}
# Accepted at any value: they only shape how output is streamed, never what is generated.
_IGNORED_KEYS = ("stream_interval",)
_KNOWN_KEYS = set(SamplingParams.__dataclass_fields__) | set(_NEUTRAL_KEYS) | set(_IGNORED_KEYS)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{key}={value!r}: must be a number")
    return float(value)


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key}={value!r}: must be an integer")
    return value


def _as_list(key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"sampling_params.{key}={value!r}: must be a list")
    return value



def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32) and return (tokens [B], logprobs [B]).

    Greedy rows (temperature 0) take the argmax. Other rows sample from softmax(logits / T)
    restricted by top-k then top-p, using the row's own generator (exponential-race sampling:
    argmax(p / E) with E ~ Exp(1) draws from p). The returned log-prob is
    log_softmax(logits / T)[token] (raw logits at T = 0), without the top-k/top-p filter.
    """
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        sub = scaled[sampled_rows]
        sub = _filter_top_k_top_p(sub, [params[i] for i in sampled_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.stack(
            [
                torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generators[i])
                for i in sampled_rows
            ]
        )
        tokens[sampled_rows] = (probs / noise).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _filter_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf."""
    vocab = scaled.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    drop = rank >= torch.tensor(ks, device=scaled.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = torch.tensor(ps, dtype=probs.dtype, device=scaled.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
