"""A two-turn environment on count-shapes rows for tests/rollout/test_env_vision.py, imported by a run's Ray workers
(the test puts this folder on their PYTHONPATH): the model says the count, the environment answers ``again:``
and the model must say it again. Both turns are scored on the image's count (the row's label), so the second
turn's reward depends on the image as much as the first's.

Two recorders, each writing JSON lines to the file an environment variable names (unset: nothing is recorded):

- :func:`record_samples` (``custom_rollout_log_function``, in the driver): every sample a step trains on;
- the first :class:`CountTwice` made in a process wraps that process's :class:`EngineClient` ``generate`` so that
  every ``/generate`` request the rollout sends (its ``input_ids`` and ``image_data``, as they go on the wire) is
  written down before it is sent.

>>> env = CountTwice(); env.reset("<image>count:", "3", {})
>>> step = env.step("3"); step.observation, step.reward, step.done
(' again:', 0.5, False)
>>> step = env.step("2"); step.observation, step.reward, step.done
('', 0.125, True)
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

from raygym.builtin.count_shapes import count_shapes_reward
from raygym.envs import Environment, Step

OBSERVATION = " again:"
SAMPLES_OUT = "RAYGYM_TEST_VISION_SAMPLES"  # record_samples appends each step's samples here
REQUESTS_OUT = "RAYGYM_TEST_VISION_REQUESTS"  # the episodes' process appends every /generate request here

_lock = threading.Lock()
_recording = False


def _append(path: str, record: dict[str, Any]) -> None:
    with _lock, open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def record_requests(path: str) -> None:
    """Write every ``/generate`` request this process's engine clients send to ``path`` (once per process)."""
    global _recording
    from raygym.engine_api.client import EngineClient

    with _lock:
        if _recording:
            return
        _recording = True
    send = EngineClient.generate

    @functools.wraps(send)
    async def generate(self: EngineClient, request: Any, **kwargs: Any) -> Any:
        _append(path, {"input_ids": request.input_ids, "image_data": request.image_data, "pid": os.getpid(),
                       "sampling_params": request.sampling_params})
        return await send(self, request, **kwargs)

    EngineClient.generate = generate  # type: ignore[method-assign]


class CountTwice(Environment):
    """Turn 1: the count (half a count-shapes reward); the environment answers ``again:``; turn 2: the count again
    (the other half)."""

    def __init__(self) -> None:
        if os.environ.get(REQUESTS_OUT):
            record_requests(os.environ[REQUESTS_OUT])

    def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> None:
        self.label, self.turns = str(label), 0

    def step(self, action: str) -> Step:
        self.turns += 1
        reward = 0.5 * count_shapes_reward(action, self.label)
        if self.turns == 1:
            return Step(observation=OBSERVATION, reward=reward)
        return Step(reward=reward, done=True)


def record_samples(step: int, samples: list[Any], row: dict[str, Any]) -> None:
    """``custom_rollout_log_function``: the samples of step ``step`` as the driver hands them to the trainer."""
    for s in samples:
        _append(os.environ[SAMPLES_OUT], {
            "step": step, "data_index": s.data_index, "group_index": s.group_index, "label": s.label,
            "images": list(s.images), "prompt_tokens": list(s.prompt_tokens), "response_tokens": list(s.response_tokens),
            "loss_mask": s.effective_loss_mask(), "rollout_log_probs": list(s.rollout_log_probs), "reward": s.reward,
            "weight_version": s.weight_version, "metrics": dict(s.metrics), "env_reward": s.metadata.get("env_reward"),
            "env_error": s.metadata.get("env_error")})
