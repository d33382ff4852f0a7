"""Fully asynchronous generation (``fully_async``) inside the rollout manager: a producer keeps groups in flight
on the engines without waiting for the trainer, the trainer takes each step's groups as they complete.

The bookkeeping (admission by ``max_staleness``, freshness, what a checkpoint keeps) is
:class:`raygym.rollout.async_buffer.AsyncBuffer`'s; this module runs it on the manager's event loop. A prompt's
``key`` is its place in the run's prompt stream (``PromptDataset.position``), so its sampling seeds, and the
prompt itself after a resume, are found again from the key alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from raygym.data.prompts import PromptDataset, PromptRow
from raygym.engines.health import EnginePool
from raygym.errors import RaygymError
from raygym.rollout.async_buffer import AsyncBuffer, PendingPrompt
from raygym.rollout.filters import GroupFilter
from raygym.types import Sample

SEED_SCOPE = ("async",)  # sampling seeds of a fully asynchronous run: (run seed, "async", key, sample)


class GroupProducer(Protocol):
    """What the stream uses of the rollout manager."""

    dataset: PromptDataset
    group_filter: GroupFilter | None
    pool: EnginePool
    weight_version: int  # the policy version the engines serve
    continued: int  # continuation requests sent (partial rollouts)

    def sampling_params(self, evaluation: bool = False) -> dict[str, Any]: ...

    async def generate_group(self, row: PromptRow, params: dict[str, Any], n: int | None = None, *,
                             group_key: int | None = None, scope: tuple[Any, ...] | None = None) -> list[Sample]: ...


class AsyncStream:
    """The producer and the buffer of one fully asynchronous run (see the module docstring).

    ``pending``: the keys a checkpoint kept (started and not trained); they are generated first.
    """

    def __init__(self, manager: GroupProducer, *, batch_size: int, max_staleness: int, policy: str,
                 first_step: int, pending: list[int]) -> None:
        self.manager = manager
        self.buffer: AsyncBuffer[list[Sample]] = AsyncBuffer(
            batch_size=batch_size, max_staleness=max_staleness, policy=policy, first_step=first_step)
        self.buffer.resume_with([PendingPrompt(k, manager.dataset.row_at(k)) for k in pending])
        self._wake_producer = asyncio.Event()
        self._group_done = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._producer: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._filtered = 0
        self._last_take = time.monotonic()

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._producer = asyncio.create_task(self._produce(), name="raygym-async-producer")

    async def stop(self) -> None:
        """Cancel the producer and everything in flight (their prompts stay in :meth:`pending_keys`)."""
        tasks = [t for t in (self._producer, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None
        if tasks:
            await self.manager.pool.abort_all()

    def wake(self) -> None:
        """The engines' weight version moved: more groups may start."""
        self._wake_producer.set()

    def pending_keys(self) -> list[int]:
        """What a checkpoint keeps: the keys started and not yet trained (in flight, done, to regenerate)."""
        return [p.key for p in self.buffer.pending()]

    # ---- the producer -------------------------------------------------------------------------------------
    async def _produce(self) -> None:
        while True:
            for _ in range(self.buffer.admissible(self.manager.weight_version)):
                prompt = self.buffer.next_retry() or self._next_prompt()
                self.buffer.start(prompt)
                self._tasks[prompt.key] = asyncio.create_task(self._generate(prompt))
            self._wake_producer.clear()
            await self._wake_producer.wait()

    def _next_prompt(self) -> PendingPrompt:
        dataset = self.manager.dataset
        key = dataset.position
        return PendingPrompt(key, dataset.next_batch(1)[0])

    async def _generate(self, prompt: PendingPrompt) -> None:
        m = self.manager
        try:
            group = await m.generate_group(prompt.row, m.sampling_params(), group_key=prompt.key, scope=SEED_SCOPE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced by take(): the trainer must not wait on a group that never comes
            self._error = exc
            self._group_done.set()
            return
        finally:
            self._tasks.pop(prompt.key, None)
        for sample in group:
            sample.prompt_key = prompt.key
        if m.group_filter is not None and not m.group_filter(group):
            self._filtered += 1
            self.buffer.discard(prompt.key)
            self._wake_producer.set()
        else:
            self.buffer.finish(prompt.key, group, min_version=min(s.weight_version for s in group))
        self._group_done.set()

    # ---- the trainer side ---------------------------------------------------------------------------------
    async def take(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """``batch_size`` groups fresh enough for ``step`` (waiting for them), as one flat sample list with
        ``group_index`` 0..B-1, and the ``async/*`` metrics of the wait."""
        start = time.monotonic()
        while True:
            if self._error is not None:
                raise RaygymError(f"fully asynchronous generation failed: {type(self._error).__name__}: "
                                  f"{self._error}") from self._error
            if self.buffer.drop_stale(step):
                self._wake_producer.set()  # regenerated prompts start again
            if self.buffer.ready(step):
                break
            if self._producer is None or self._producer.done():
                raise RaygymError("the asynchronous producer is not running; call start_stream first")
            if not self.buffer.in_flight and not self.buffer.retry and \
                    not self.buffer.admissible(self.manager.weight_version):
                raise RaygymError(
                    f"step {step} waits for groups nothing may generate: none in flight, and the engines' weight "
                    f"version {self.manager.weight_version} admits none (max_staleness={self.buffer.max_staleness})")
            self._group_done.clear()
            await self._group_done.wait()
        taken = self.buffer.take(step)
        self._wake_producer.set()  # the trainer consumed: more groups may start
        samples: list[Sample] = []
        for index, (_, group) in enumerate(taken.groups):
            for sample in group:
                sample.group_index = index
            samples.extend(group)
        now = time.monotonic()
        metrics = {
            "async/wait_s": now - start,
            "async/interval_s": now - self._last_take,
            "async/buffered_groups": float(len(self.buffer.done)),
            "async/in_flight_groups": float(len(self.buffer.in_flight)),
            "async/stale_regenerated": float(self.buffer.regenerated),
            "async/stale_dropped": float(self.buffer.stale_dropped),
            "async/filtered_groups": float(self._filtered),
            "async/continuations": float(self.manager.continued),
        }
        self._last_take = now
        return samples, metrics


def staleness_metrics(samples: list[Sample], trainer_version: int, max_staleness: int) -> dict[str, Any]:
    """How old the policies behind ``samples`` are when the trainer at ``trainer_version`` trains on them:
    ``rollout/staleness_mean`` / ``_max`` (of each sample's oldest token), ``rollout/staleness_<k>_frac`` for
    k = 0..max_staleness, and ``rollout/mixed_version_frac`` (samples whose tokens came from two or more
    versions: a weight update landed while they were generated).

    >>> s = [Sample(prompt="", prompt_tokens=[1], group_index=0, weight_version=v, token_versions=t)
    ...      for v, t in ((3, [3, 3]), (2, [2, 3]))]
    >>> m = staleness_metrics(s, 3, 1)
    >>> m["rollout/staleness_max"], m["rollout/staleness_1_frac"], m["rollout/mixed_version_frac"]
    (1.0, 0.5, 0.5)
    """
    ages = [trainer_version - s.weight_version for s in samples]
    out: dict[str, Any] = {
        "rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "rollout/staleness_max": float(max(ages, default=0)),
        "rollout/mixed_version_frac": (sum(s.max_version != s.weight_version for s in samples) / len(samples)
                                       if samples else 0.0),
    }
    for k in range(max_staleness + 1):
        out[f"rollout/staleness_{k}_frac"] = sum(a == k for a in ages) / len(ages) if ages else 0.0
    return out
