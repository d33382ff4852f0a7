"""The two sides ``raygym bench rollout`` times, shared with its by-engine figures (``rollout_engines``): the
model sizes, the prompts, HF ``generate`` on one batch in process, and an engine answering each prompt as its own
concurrent request."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from raygym.builtin import build_tokenizer, next_digit_rows
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import EngineActor

# ~10M parameters: 10 layers of hidden 256 / MLP 1024 on the builtin character vocabulary.
ARCHS = {
    "tiny": {},
    "10m": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    tok = build_tokenizer()
    rng = random.Random(seed)
    return [tok.encode("q" * rng.randrange(0, 24) + row["prompt"]) for row in next_digit_rows(n, seed)]


def baseline_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return elapsed


def server_seconds(
    actor: EngineActor, pool: ThreadPoolExecutor, prompts: list[list[int]], new_tokens: int
) -> float:
    def one(p: list[int]) -> int:
        out = actor.generate(GenerateRequest(
            input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        ))
        assert not isinstance(out, list), "one prompt, one answer"
        return out["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    produced = sum(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * new_tokens
    return elapsed
