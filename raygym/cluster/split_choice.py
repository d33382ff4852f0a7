"""The split of devices between engines and trainer chosen from measured rates (``auto_split``). Pure.

When engines generate while the trainer trains (an asynchronous schedule on disjoint devices), a step takes as
long as the slower side: ``max(rollout work / engine devices, train work / trainer devices)``. Both works are
measured over the first steps of a run, as device-seconds (a side's median phase time times the devices it ran
on), and the split that balances them is chosen among the splits the cluster allows: cores of a node on CPU,
GPUs on a cluster. The model scales each side linearly with its devices, which is what data-parallel engines
and trainer ranks do to first order; it is re-measured each time a run re-picks.

>>> measured = MeasuredSplit(engine_devices=4, trainer_devices=4, rollout_s=3.0, train_s=1.0, steps=4)
>>> choice = choose_split(measured, [(g, 8 - g) for g in range(1, 8)], unit="cores")
>>> choice.engine_devices, choice.trainer_devices, round(choice.gain_over_even, 2)
(6, 2, 1.5)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A re-pick must predict at least this gain over the split that was measured, or the split is kept: the model
# is first-order and moving engines costs a restart from the checkpoint.
MIN_GAIN = 1.05


@dataclass(frozen=True)
class MeasuredSplit:
    """What the first steps measured: the devices each side had and its median phase time per step."""

    engine_devices: int
    trainer_devices: int
    rollout_s: float  # the engines' generation time of one step's samples
    train_s: float  # the trainer's time on one step (old log-probs, if any, and the optimizer steps)
    steps: int  # how many steps the medians are over

    @property
    def rollout_work(self) -> float:
        """Device-seconds of generation per step."""
        return self.rollout_s * self.engine_devices

    @property
    def train_work(self) -> float:
        """Device-seconds of training per step."""
        return self.train_s * self.trainer_devices


@dataclass(frozen=True)
class SplitChoice:
    """The chosen split, what it predicts, and what an even split and the measured one predict."""

    engine_devices: int
    trainer_devices: int
    predicted_step_s: float
    measured_step_s: float  # the model's step time for the split that was measured
    even_step_s: float | None  # None when no allowed split gives both sides the same devices
    measured: MeasuredSplit
    unit: str  # "cores" or "GPUs"
    choices: int  # how many splits were allowed

    @property
    def changed(self) -> bool:
        """Whether the choice differs from the measured split."""
        return (self.engine_devices, self.trainer_devices) != (self.measured.engine_devices,
                                                               self.measured.trainer_devices)

    @property
    def gain_over_even(self) -> float:
        """Predicted samples/s of the choice over the even split's (1.0 when there is no even split)."""
        return self.even_step_s / self.predicted_step_s if self.even_step_s else 1.0

    def reason(self) -> str:
        """One line: what was measured, what was chosen, and why.

        >>> m = MeasuredSplit(engine_devices=1, trainer_devices=1, rollout_s=2.0, train_s=1.0, steps=3)
        >>> print(choose_split(m, [(1, 1)], unit="cores").reason())
        kept engines 1 cores, trainer 1 cores: the only split allowed (steps 1-3 measured rollout 2.00 s on 1, train 1.00 s on 1)
        """
        m = self.measured
        seen = (f"steps 1-{m.steps} measured rollout {m.rollout_s:.2f} s on {m.engine_devices}, "
                f"train {m.train_s:.2f} s on {m.trainer_devices}")
        split = f"engines {self.engine_devices} {self.unit}, trainer {self.trainer_devices} {self.unit}"
        if not self.changed:
            why = ("the only split allowed" if self.choices == 1 else
                   f"no other allowed split predicts {MIN_GAIN:.2f}x its rate")
            return f"kept {split}: {why} ({seen})"
        even = f", {self.gain_over_even:.2f}x an even split" if self.even_step_s else ""
        return (f"chose {split}: predicted {self.predicted_step_s:.2f} s a step against "
                f"{self.measured_step_s:.2f} s for the measured split{even} ({seen})")


def measured_from_rows(rows: Sequence[Mapping[str, Any]], engine_devices: int, trainer_devices: int,
                       skip: int = 1) -> MeasuredSplit:
    """Median phase times of the metrics rows (``rollout/generate_time``; ``perf/train_time`` plus
    ``perf/log_probs_time``), leaving out the first ``skip`` rows (warm-up).

    >>> rows = [{"rollout/generate_time": t, "perf/train_time": 1.0} for t in (9.0, 2.0, 3.0, 4.0)]
    >>> measured_from_rows(rows, 1, 1).rollout_s
    3.0
    """
    kept = list(rows[skip:]) or list(rows)
    assert kept, "no metrics rows to measure"
    rollout = statistics.median(float(r.get("rollout/generate_time", 0.0)) for r in kept)
    train = statistics.median(float(r.get("perf/train_time", 0.0)) + float(r.get("perf/log_probs_time", 0.0))
                              for r in kept)
    return MeasuredSplit(engine_devices=engine_devices, trainer_devices=trainer_devices, rollout_s=rollout,
                         train_s=train, steps=len(rows))


def predicted_step_s(measured: MeasuredSplit, engine_devices: int, trainer_devices: int) -> float:
    """The overlapped step time of a split: the slower side, each side's work spread over its devices."""
    return max(measured.rollout_work / engine_devices, measured.train_work / trainer_devices)


def choose_split(measured: MeasuredSplit, allowed: Sequence[tuple[int, int]], *, unit: str) -> SplitChoice:
    """The allowed ``(engine devices, trainer devices)`` split with the shortest predicted step; the measured
    split is kept unless another predicts :data:`MIN_GAIN` its rate. Ties go to the split nearest even."""
    assert allowed, "no split allowed"
    here = (measured.engine_devices, measured.trainer_devices)
    here_s = predicted_step_s(measured, *here)
    best = min(allowed, key=lambda split: (predicted_step_s(measured, *split), abs(split[0] - split[1])))
    best_s = predicted_step_s(measured, *best)
    if here in allowed and here_s <= best_s * MIN_GAIN:
        best, best_s = here, here_s
    even = [s for s in allowed if s[0] == s[1]]
    return SplitChoice(engine_devices=best[0], trainer_devices=best[1], predicted_step_s=best_s,
                       measured_step_s=here_s,
                       even_step_s=predicted_step_s(measured, *even[0]) if even else None,
                       measured=measured, unit=unit, choices=len(allowed))


def cpu_splits(cores: int, trainer_ranks: int) -> list[tuple[int, int]]:
    """Core splits of a node: engines get 1 .. ``cores - trainer_ranks`` cores, each trainer rank at least one.

    >>> cpu_splits(2, 1), cpu_splits(8, 2)[:2], cpu_splits(2, 2)
    ([(1, 1)], [(1, 7), (2, 6)], [])
    """
    return [(g, cores - g) for g in range(1, cores - trainer_ranks + 1)]
