"""On-policy distillation: a teacher scores the student's own samples token by token, and the per-token
reverse KL becomes the advantage.

For each sampled response token t, with the student's log-prob ``s_t`` (the log-probs the rollout
sampled with, or the trainer's old-policy pass when it ran) and the teacher's ``p_t`` on the same
context, the advantage is::

    A_t = distill_task_weight * A_task_t + distill_kl_coef * (p_t - s_t)

``p_t - s_t`` is minus a one-sample estimate of the reverse KL(student || teacher) at that token, so
maximising it pulls the student's own trajectories toward what the teacher would have said; the task
reward's usual advantage (GRPO, ...) is kept with its weight (0 = pure distillation). Tokens outside
the loss mask (environment observations) get advantage 0.

The teacher is :class:`TeacherActor`: the teacher model in a Ray actor on its own GPU(s) (started by
:mod:`raygym.run.aux_groups`), computing prompt + response log-probs in one forward pass per batch.
:class:`TeacherScorer` is what the rollout manager calls; anything with the same ``score(samples)``
coroutine can stand in for it (for example a scorer that asks an SGLang engine for
``input_token_logprobs``).

>>> reverse_kl_per_token([-1.0, -0.5], [-2.0, -0.5], [1, 1])
[1.0, 0.0]
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from raygym.types import Sample


def reverse_kl_per_token(student: Sequence[float], teacher: Sequence[float], mask: Sequence[int]) -> list[float]:
    """``s_t - p_t`` on trained tokens (0 elsewhere): the per-token reverse-KL estimate on the sampled tokens."""
    if not len(student) == len(teacher) == len(mask):
        raise ValueError(f"{len(student)} student, {len(teacher)} teacher log-probs and {len(mask)} mask entries")
    return [(s - p) if m else 0.0 for s, p, m in zip(student, teacher, mask, strict=True)]


def distill_advantages(batch: Any, samples: Sequence[Sample], *, kl_coef: float, task_weight: float) -> Any:
    """``batch`` (a :class:`raygym.trainer.batch.TrainBatch` with task advantages) with the distillation
    advantages above."""
    import torch

    student = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
    if student is None:
        raise ValueError("distillation needs the student's log-probs (rollout or old-policy) for every sample")
    advantages = []
    for i, sample in enumerate(samples):
        if sample.teacher_log_probs is None:
            raise ValueError(f"sample {i} has no teacher log-probs: the teacher did not score it")
        mask = batch.loss_masks[i].float()
        teacher = torch.tensor(sample.teacher_log_probs, dtype=torch.float32)
        task = batch.advantages[i].float() if batch.advantages is not None else torch.zeros_like(mask)
        advantages.append((task_weight * task + kl_coef * (teacher - student[i].float())) * mask)
    return replace(batch, advantages=advantages)  # returns (the critic's targets, PPO) stay the task's


class TeacherActor:
    """The teacher model, scoring token sequences (a Ray actor body; torch loads in ``__init__``)."""

    def __init__(self, model_path: str, device: str = "auto", max_tokens_per_batch: int = 16384) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.max_tokens_per_batch = max_tokens_per_batch

    def ready(self) -> bool:
        return True

    def log_probs(self, sequences: list[list[int]], prompt_lengths: list[int],
                  temperature: float = 1.0) -> list[list[float]]:
        """Per sequence, the log-prob of every token after its prompt given everything before it
        (``log_softmax(logits / temperature)``, plain at temperature 0)."""
        import torch

        out: list[list[float]] = [[] for _ in sequences]
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and len(sequences[order[end]]) * (end - start + 1) <= self.max_tokens_per_batch:
                end += 1
            rows = order[start:end]
            width = max(len(sequences[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[r, : len(sequences[i])] = 1
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
                if temperature > 0:
                    logits = logits / temperature
                logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0]
            for r, i in enumerate(rows):
                first = prompt_lengths[i] - 1  # position whose logits predict the first response token
                out[i] = logp[r, first: len(sequences[i]) - 1].cpu().tolist()
            start = end
        return out


class TeacherScorer:
    """Sets ``sample.teacher_log_probs`` for a step's samples, split over the teacher actors."""

    def __init__(self, teacher_handles: Sequence[Any], temperature: float = 1.0) -> None:
        if not teacher_handles:
            raise ValueError("TeacherScorer needs at least one teacher actor")
        self.handles = list(teacher_handles)
        self.temperature = temperature

    async def score(self, samples: Sequence[Sample]) -> None:
        shares = [list(samples[k:: len(self.handles)]) for k in range(len(self.handles))]

        async def one(handle: Any, share: list[Sample]) -> None:
            if not share:
                return
            result = await handle.log_probs.remote([s.prompt_tokens + s.response_tokens for s in share],
                                                   [len(s.prompt_tokens) for s in share], self.temperature)
            for sample, values in zip(share, result, strict=True):
                if len(values) != sample.response_length:
                    raise RuntimeError(f"the teacher scored {len(values)} of {sample.response_length} tokens")
                sample.teacher_log_probs = values

        await asyncio.gather(*(one(h, s) for h, s in zip(self.handles, shares, strict=True)))
