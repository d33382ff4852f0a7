"""The bookkeeping of fully asynchronous training (``fully_async``), pure: which groups may start, which are done,
which are fresh enough to train on, and what a checkpoint must keep so a resumed run trains on every prompt once.

Groups are numbered by ``key`` in the order they start (the run's prompt order). A group started while the engines
serve version ``v`` is meant to be trained by step ``v + max_staleness`` at the latest, so at most
``(v + max_staleness + 1) * batch_size`` groups may have started (AReaL's rule, counted from the run's first
step): generation runs ahead of the trainer by up to ``max_staleness`` steps and never further. A group that
still comes back too old (a long response, a slow engine) is never trained silently: it is dropped or generated
again (``stale_sample_policy``), and counted.

>>> buf = AsyncBuffer(batch_size=2, max_staleness=1, policy="regenerate", first_step=0)
>>> buf.admissible(engine_version=0)          # steps 0 and 1 may be generated ahead
4
>>> buf.start(PendingPrompt(key=0, row=None)); buf.start(PendingPrompt(key=1, row=None))
>>> buf.finish(0, "g0", min_version=0); buf.finish(1, "g1", min_version=0)
>>> [g for _, g in buf.take(step=0).groups]
['g0', 'g1']
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

G = TypeVar("G")
STALE_POLICIES = ("regenerate", "drop")


@dataclass(frozen=True)
class PendingPrompt:
    """A prompt whose group has started (or must start again): its run-wide ``key`` (names its sampling seeds)
    and its data row (``raygym.data.prompts.PromptRow``; opaque here)."""

    key: int
    row: Any


@dataclass
class Taken(Generic[G]):
    """What :meth:`AsyncBuffer.take` hands the trainer: ``groups`` as (key, group), oldest first, and what was
    found too old on the way (``stale``: keys dropped or sent back to be generated again)."""

    groups: list[tuple[int, G]]
    stale: list[int] = field(default_factory=list)


@dataclass
class _Done(Generic[G]):
    key: int
    group: G
    min_version: int
    prompt: PendingPrompt


class AsyncBuffer(Generic[G]):
    """Admission, completion and freshness of the groups of a fully asynchronous run."""

    def __init__(self, *, batch_size: int, max_staleness: int, policy: str, first_step: int) -> None:
        if policy not in STALE_POLICIES:
            raise ValueError(f"policy={policy!r}: one of {STALE_POLICIES}")
        if batch_size < 1 or max_staleness < 0:
            raise ValueError(f"batch_size={batch_size}, max_staleness={max_staleness}: need >= 1 and >= 0")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.policy = policy
        self.first_step = first_step
        self.started = 0  # groups started since first_step (a regenerated prompt starts again and counts again)
        self.consumed = 0  # groups handed to the trainer since first_step
        self.in_flight: dict[int, PendingPrompt] = {}
        self.done: deque[_Done[G]] = deque()
        self.retry: deque[PendingPrompt] = deque()  # prompts to start (again) before new ones
        self.stale_dropped = 0
        self.regenerated = 0

    # ---- the producer side --------------------------------------------------------------------------------
    def admissible(self, engine_version: int) -> int:
        """How many more groups may start while the engines serve ``engine_version``."""
        allowed = (engine_version - self.first_step + self.max_staleness + 1) * self.batch_size
        return max(0, allowed - self.consumed - self.outstanding())

    def outstanding(self) -> int:
        """Groups started and not yet handed to the trainer (in flight or done and waiting)."""
        return len(self.in_flight) + len(self.done)

    def next_retry(self) -> PendingPrompt | None:
        """A prompt that must be generated (again) before any new one: resumed or regenerated."""
        return self.retry.popleft() if self.retry else None

    def start(self, prompt: PendingPrompt) -> None:
        assert prompt.key not in self.in_flight, f"group {prompt.key} started twice"
        self.in_flight[prompt.key] = prompt
        self.started += 1

    def finish(self, key: int, group: G, *, min_version: int) -> None:
        """Group ``key`` is generated and scored; the oldest weight version any of its tokens came from is
        ``min_version``."""
        prompt = self.in_flight.pop(key)
        self.done.append(_Done(key, group, min_version, prompt))

    def discard(self, key: int) -> None:
        """Group ``key`` ended without anything to train (a dynamic-sampling filter dropped it): its prompt is
        consumed, like the synchronous loop's."""
        self.in_flight.pop(key)

    # ---- the trainer side ---------------------------------------------------------------------------------
    def ready(self, step: int) -> bool:
        """Whether :meth:`take` for ``step`` finds ``batch_size`` fresh groups now (after it removed stale
        ones, which :meth:`take` does)."""
        return sum(d.min_version >= step - self.max_staleness for d in self.done) >= self.batch_size

    def take(self, step: int) -> Taken[G]:
        """``batch_size`` groups generated by policy versions ``>= step - max_staleness`` (call when
        :meth:`ready`), in the order they finished; groups found older are dropped or queued to be generated
        again, never returned."""
        out: Taken[G] = Taken(groups=[], stale=self.drop_stale(step))
        assert len(self.done) >= self.batch_size, "take() before ready()"
        out.groups = [(d.key, d.group) for d in list(self.done)[:self.batch_size]]
        self.done = deque(list(self.done)[self.batch_size:])
        self.consumed += self.batch_size
        return out

    def drop_stale(self, step: int) -> list[int]:
        """Remove the done groups too old for ``step`` now (so :meth:`ready` counts only fresh ones); their
        keys."""
        fresh_from = step - self.max_staleness
        stale = [d for d in self.done if d.min_version < fresh_from]
        if not stale:
            return []
        self.done = deque(d for d in self.done if d.min_version >= fresh_from)
        for d in stale:
            if self.policy == "regenerate":
                self.retry.append(d.prompt)
                self.regenerated += 1
            else:
                self.stale_dropped += 1
        return [d.key for d in stale]

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def pending(self) -> list[PendingPrompt]:
        """Every prompt started and not yet trained, plus those waiting to start again, by key: what a
        checkpoint keeps (a resumed run generates them first, then goes on with new prompts)."""
        prompts = [*self.in_flight.values(), *(d.prompt for d in self.done), *self.retry]
        return sorted(prompts, key=lambda p: p.key)

    def resume_with(self, prompts: list[PendingPrompt]) -> None:
        """Start from a checkpoint's :meth:`pending` prompts (before anything else)."""
        assert not self.in_flight and not self.done and not self.retry, "resume_with() on a used buffer"
        self.retry.extend(sorted(prompts, key=lambda p: p.key))
