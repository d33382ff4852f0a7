"""The ``rollout/*`` and ``eval/*`` numbers of a batch of scored samples, pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from raygym.rewards.scoring import pass_at_k
from raygym.types import Sample


def rollout_batch_metrics(samples: Sequence[Sample], seen: Sequence[Sample], elapsed: float, *, failures: int,
                          retries: int, malformed: int = 0, moved: int = 0) -> dict[str, float]:
    """Reward, length and throughput of the ``samples`` a step trains on; ``seen`` is everything generated for
    it (kept or not; empty = the samples), ``elapsed`` the seconds it took. ``failures`` (engines that failed),
    ``retries`` (requests sent again), ``malformed`` (answers that did not fit the protocol) and ``moved``
    (requests taken off an engine that left rotation while they were in flight) count the step's engine trouble.

    >>> s = Sample(prompt="", prompt_tokens=[1], group_index=0, response_tokens=[2, 3], reward=1.0)
    >>> m = rollout_batch_metrics([s], [], 2.0, failures=0, retries=0)
    >>> m["rollout/reward_mean"], m["rollout/tokens_per_s"]
    (1.0, 1.0)
    """
    rewards = [float(s.reward or 0.0) for s in samples]
    lengths = [s.response_length for s in samples]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0
    generated = sum(s.response_length for s in seen) if seen else sum(lengths)
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": std,
        "rollout/response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_frac": (sum(s.finish_reason == "length" for s in samples) / len(samples)
                                   if samples else 0.0),
        "rollout/reward_errors": float(sum(s.reward_error is not None for s in (seen or samples))),
        "rollout/generated_tokens": float(generated),
        "rollout/tokens_per_s": generated / elapsed if elapsed > 0 else 0.0,
        "rollout/samples": float(len(samples)),
        "rollout/engine_failures": float(failures),
        "rollout/request_retries": float(retries),
        "rollout/malformed_answers": float(malformed),
        "rollout/requests_moved": float(moved),
        "perf/rollout_time": elapsed,
    }


def eval_dataset_metrics(prefix: str, groups: Sequence[Sequence[Sample]], n: int, pass_threshold: float
                         ) -> dict[str, float]:
    """One eval dataset's ``reward_mean``, unbiased ``pass@n`` and ``pass@1`` (a sample passes with a reward
    of at least ``pass_threshold``), ``response_len_mean``, ``truncated_frac`` and ``reward_errors``."""
    samples = [s for g in groups for s in g]
    correct = [sum(float(s.reward or 0.0) >= pass_threshold for s in g) for g in groups]
    return {
        prefix + "reward_mean": sum(float(s.reward or 0.0) for s in samples) / len(samples),
        prefix + f"pass@{n}": sum(pass_at_k(n, c, n) for c in correct) / len(groups),
        prefix + "pass@1": sum(pass_at_k(n, c, 1) for c in correct) / len(groups),
        prefix + "response_len_mean": sum(s.response_length for s in samples) / len(samples),
        prefix + "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        prefix + "reward_errors": float(sum(s.reward_error is not None for s in samples)),
    }
