"""How a run interleaves generation and training, as one typed value: :data:`Schedule` (pure).

- :class:`Sync`: generate a step's groups, train on them, sync the weights, repeat (``schedule="sync"``, the
  default).
- :class:`OneStepOff`: step ``n + 1`` is generated while step ``n`` trains, one policy version behind
  (``schedule="one_step_off"``; the reference recipe's ``async_mode=True``).
- :class:`FullyAsync`: engines generate continuously and updates land while requests are in flight; a sample's
  oldest token is at most ``max_staleness`` versions older than the trainer, a group older than that is
  regenerated or dropped (``schedule="fully_async"``; ``fully_async=True``).

The recipe stores the schedule in its flat fields (``async_mode``, ``fully_async``, ``max_staleness``,
``stale_sample_policy``: the reference recipe's names and raygym's flags, which keep working); components read
``recipe.schedule``, one of the three classes, and match on it.

>>> schedule_of(async_mode=False, fully_async=True, max_staleness=3, stale_sample_policy="drop")
FullyAsync(max_staleness=3, stale_sample_policy='drop')
>>> schedule_fields("one_step_off", {})
{'async_mode': True, 'fully_async': False}
>>> schedule_fields("sync", {"fully_async": True})
Traceback (most recent call last):
...
raygym.errors.ConfigError: schedule='sync' and fully_async=True disagree; give one of them (--schedule sync, or --fully-async alone)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from raygym.errors import ConfigError

SCHEDULE_NAMES = ("sync", "one_step_off", "fully_async")
StaleSamplePolicy = Literal["regenerate", "drop"]


@dataclass(frozen=True)
class Sync:
    """Generate, train, sync: every sample comes from the policy the trainer holds."""

    name: ClassVar[Literal["sync"]] = "sync"

    def describe(self) -> str:
        return "sync (generate, train, sync weights; on-policy)"


@dataclass(frozen=True)
class OneStepOff:
    """The next step is generated while this one trains: every sample is one policy version old."""

    name: ClassVar[Literal["one_step_off"]] = "one_step_off"

    def describe(self) -> str:
        return "one_step_off (step n+1 generates while step n trains; samples one version old)"


@dataclass(frozen=True)
class FullyAsync:
    """Continuous generation, updates in flight, staleness bounded by ``max_staleness``."""

    name: ClassVar[Literal["fully_async"]] = "fully_async"
    max_staleness: int = 2
    stale_sample_policy: StaleSamplePolicy = "regenerate"

    def describe(self) -> str:
        return (f"fully_async (generation runs up to {self.max_staleness} steps ahead; a group older than that is "
                f"{'regenerated' if self.stale_sample_policy == 'regenerate' else 'dropped'})")


Schedule = Sync | OneStepOff | FullyAsync


def schedule_of(*, async_mode: bool, fully_async: bool, max_staleness: int, stale_sample_policy: str) -> Schedule:
    """The schedule the recipe's flat fields describe (validated fields: at most one mode is on)."""
    assert not (async_mode and fully_async), "recipe checks reject two asynchronous modes"
    if fully_async:
        assert stale_sample_policy in ("regenerate", "drop"), stale_sample_policy
        return FullyAsync(max_staleness, "regenerate" if stale_sample_policy == "regenerate" else "drop")
    return OneStepOff() if async_mode else Sync()


def spell_schedule(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with a ``schedule`` entry replaced by the flat fields it stands for (unchanged without one).

    >>> spell_schedule({"schedule": "fully_async", "max_staleness": 3})
    {'max_staleness': 3, 'async_mode': False, 'fully_async': True}
    """
    if "schedule" not in fields:
        return fields
    rest = {k: v for k, v in fields.items() if k != "schedule"}
    return {**rest, **schedule_fields(fields["schedule"], rest)}


def off_policy_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with TIS on (``use_tis=True``) when the schedule is off-policy (one-step-off or fully
    asynchronous) and ``use_tis`` is not given. A sample then comes from weights one or more updates old; the
    truncated importance weight against the engine's log-probs is what keeps such a run stable (one-step-off
    without it collapsed at step 28-39 on the long-tail task), and it costs no extra pass
    (:func:`raygym.trainer.decisions.reuses_current_log_probs`). An explicit ``use_tis=False`` stays off.

    >>> off_policy_defaults({"async_mode": True})["use_tis"], off_policy_defaults({"fully_async": True})["use_tis"]
    (True, True)
    >>> off_policy_defaults({"async_mode": True, "use_tis": False})["use_tis"], "use_tis" in off_policy_defaults({})
    (False, False)
    """
    if "use_tis" in fields or not (fields.get("async_mode") or fields.get("fully_async")):
        return fields
    return {**fields, "use_tis": True}


def schedule_fields(spelled: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The flat recipe fields a ``schedule`` value stands for: a name (``"fully_async"``) or a :data:`Schedule`
    (which also carries ``FullyAsync``'s bound and policy). ``given``: the fields passed beside it; a mode field
    turned on for another schedule is a ConfigError naming both (one left off, as in a recipe's ``model_dump()``,
    is the schedule's to set)."""
    name: str
    if isinstance(spelled, (Sync, OneStepOff, FullyAsync)):
        name = spelled.name
    elif isinstance(spelled, str) and spelled in SCHEDULE_NAMES:
        name = spelled
    else:
        raise ConfigError(f"schedule={spelled!r}: not a schedule; use one of {', '.join(map(repr, SCHEDULE_NAMES))} "
                          "(or raygym.config.schedule.Sync(), OneStepOff(), FullyAsync(max_staleness=...))")
    fields: dict[str, Any] = {"async_mode": name == "one_step_off", "fully_async": name == "fully_async"}
    for field, value in fields.items():
        if given.get(field) and not value:  # a mode turned on beside a schedule that names another one
            flag = "--async-mode" if field == "async_mode" else "--fully-async"
            raise ConfigError(f"schedule={name!r} and {field}={given[field]!r} disagree; give one of them "
                              f"(--schedule {name}, or {flag} alone)")
    if isinstance(spelled, FullyAsync):
        fields.update(max_staleness=spelled.max_staleness, stale_sample_policy=spelled.stale_sample_policy)
    return fields
