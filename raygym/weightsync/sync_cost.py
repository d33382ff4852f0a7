"""``update_weight_mode="auto"``: choose full or delta for each sync from what the last syncs cost (pure).

A delta saves bytes on the wire but costs a compare of every weight against the snapshot, and engines
checksum every tensor they touch; a full sync moves every byte. Which one is cheaper depends on the
link (loopback, a 1 Gbit/s network, an object store), the model and how much one step changes, so it
is measured rather than assumed. :class:`SyncCostModel` is fitted online from every sync of one
transport and engine kind:

- ``full``: seconds per byte of the weights (every sync moves all of them);
- the link: seconds per byte on the wire, from the transfer time of full syncs (a full sync moves
  enough bytes for the rate to be meaningful);
- ``delta``: the part that does not depend on the wire, per byte of the weights (comparing, encoding,
  applying, hashing: what the delta costs even on an infinitely fast link), plus the wire time of its
  payload; the payload is predicted from the last delta's payload/weights ratio.

So a link that gets slower raises both predictions from full syncs alone, and the model moves to delta
when the two cross. Estimates are exponential moving averages (``smoothing`` = the weight of the
newest sync); the mode in use is kept until the other is predicted ``switch_margin`` cheaper (timings
on a shared machine are noisy, and two modes within a few percent cost the same). The mode that is not chosen is measured again now and then, but only when the time it
is predicted to lose is within ``explore_budget`` of the seconds spent since it was last measured: a
mode ten times slower is rarely retried, a close one regularly. A mode never measured is tried first.

A full sync keeps the sender's delta snapshot up to date only when a delta may follow
(:attr:`ModeChoice.refresh_snapshot`): copying every weight into it costs about a tenth of a full sync
on one host, which would be wasted while full stays the cheaper mode.

The first sync pays one-time costs. Those the components time themselves (new memory allocated and first
touched: the sender's snapshot and bucket buffers, the engines' fresh regions; ``SyncSample.setup_s``)
are left out of its sample: on one host they made the seeding full sync 4x a later one, enough to
hide that full was the cheaper mode. For what is left (threads started, caches cold, a lazily created
communicator) the second sample of a mode replaces the first instead of averaging with it, and the mode of
the first sync, while measured only once, is measured again when its prediction is within
``warmup_factor`` of the better one. The other mode's first sample runs on a warm system and is trusted
(re-measuring it cost one needless sync of the dearer mode per run).

>>> model = SyncCostModel()
>>> model.observe(SyncSample("full", raw_bytes=200e6, wire_bytes=200e6, seconds=2.0, transfer_s=1.9))
>>> model.choose(200e6).mode, model.choose(200e6).reason   # delta was never measured
('delta', 'explore')
>>> model.observe(SyncSample("delta", raw_bytes=200e6, wire_bytes=12e6, seconds=0.3, transfer_s=0.15))
>>> choice = model.choose(200e6); choice.mode, choice.reason, round(choice.predicted_full_s, 2)
('delta', 'cheaper', 2.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("full", "delta")


@dataclass(frozen=True)
class SyncSample:
    """What one sync cost.

    ``raw_bytes``: every weight in the engines' dtype (what a full sync moves); ``wire_bytes``: what
    this sync moved; ``seconds``: the measured sync; ``transfer_s``: the part spent on the wire
    (sending, and the engines loading what they received); ``setup_s``: one-time work inside it that
    later syncs of either mode do not repeat (memory allocated and first touched: the sender's snapshot
    and bucket buffers, the engines' fresh regions), left out of the estimates.
    """

    mode: str
    raw_bytes: float
    wire_bytes: float
    seconds: float
    transfer_s: float
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: one of {MODES}")


@dataclass(frozen=True)
class ModeChoice:
    """The mode for the next sync and why: ``cheaper`` (the lower prediction), ``kept`` (the mode in use,
    the other not being ``switch_margin`` cheaper), ``explore`` (measured again, or for the first time),
    ``only`` (a single mode is possible), ``forced`` (a full sync the coordinator requires)."""

    mode: str
    reason: str
    predicted_full_s: float | None
    predicted_delta_s: float | None
    refresh_snapshot: bool = True  # a full sync also updates the sender's delta snapshot (a delta may follow)

    @property
    def predicted_s(self) -> float | None:
        """The prediction for the chosen mode (None when it was never measured)."""
        return self.predicted_full_s if self.mode == "full" else self.predicted_delta_s


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass
class SyncCostModel:
    """Predicts full and delta sync seconds for one transport and engine kind; picks the cheaper one.

    ``modes``: the modes the engine kind can receive over the transport (``raygym.engine_api.kinds``).
    """

    modes: tuple[str, ...] = MODES
    smoothing: float = 0.3
    switch_margin: float = 0.1
    # the price of staying informed: at most ~2.5% of sync time spent re-measuring the dearer mode (at 5%, one
    # run of 20 syncs at 10 Gbit/s paid 8% for warm-up plus exploration, too close to the 10% it may lose)
    explore_budget: float = 0.025
    warmup_factor: float = 2.0
    full_s_per_byte: float | None = None
    wire_s_per_byte: float | None = None
    delta_fixed_s_per_byte: float | None = None
    delta_payload_ratio: float | None = None
    samples: int = 0
    _spent_since: dict[str, float] = field(default_factory=lambda: {m: 0.0 for m in MODES})
    _seen: dict[str, int] = field(default_factory=lambda: {m: 0 for m in MODES})
    _incumbent: str | None = None
    _cold_mode: str | None = None  # the mode of the first sync observed (the one run on a cold system)

    def __post_init__(self) -> None:
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes={self.modes!r}: a non-empty subset of {MODES}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing={self.smoothing}: in (0, 1]")

    def observe(self, sample: SyncSample) -> None:
        """Fold one measured sync into the estimates."""
        if sample.raw_bytes <= 0 or sample.seconds < 0:
            return
        seen = self._seen[sample.mode]
        if self.samples == 0:
            self._cold_mode = sample.mode
        w = 1.0 if seen <= 1 else self.smoothing  # the second sample replaces the warm-up one
        seconds = max(0.0, sample.seconds - sample.setup_s)
        if sample.mode == "full":
            self.full_s_per_byte = _blend(self.full_s_per_byte, seconds / sample.raw_bytes, w)
            if sample.wire_bytes > 0:
                self.wire_s_per_byte = _blend(self.wire_s_per_byte, sample.transfer_s / sample.wire_bytes, w)
        else:
            wire_s = (self.wire_s_per_byte or 0.0) * sample.wire_bytes
            fixed = max(0.0, seconds - wire_s) / sample.raw_bytes
            self.delta_fixed_s_per_byte = _blend(self.delta_fixed_s_per_byte, fixed, w)
            self.delta_payload_ratio = sample.wire_bytes / sample.raw_bytes  # exact, not noisy: the latest
        self.samples += 1
        self._seen[sample.mode] = seen + 1
        for mode in MODES:
            self._spent_since[mode] += sample.seconds
        self._spent_since[sample.mode] = 0.0

    def predict(self, mode: str, raw_bytes: float) -> float | None:
        """Predicted seconds of a ``mode`` sync of weights of ``raw_bytes`` (None: not measured yet)."""
        if mode == "full":
            return None if self.full_s_per_byte is None else self.full_s_per_byte * raw_bytes
        if self.delta_fixed_s_per_byte is None or self.delta_payload_ratio is None:
            return None
        wire = (self.wire_s_per_byte or 0.0) * self.delta_payload_ratio * raw_bytes
        return self.delta_fixed_s_per_byte * raw_bytes + wire

    def choose(self, raw_bytes: float) -> ModeChoice:
        """The mode for the next sync of weights of ``raw_bytes``."""
        full, delta = self.predict("full", raw_bytes), self.predict("delta", raw_bytes)
        if len(self.modes) == 1:
            return ModeChoice(self.modes[0], "only", full, delta, refresh_snapshot=self.modes[0] == "delta")
        predicted = {"full": full, "delta": delta}
        unmeasured = [m for m in self.modes if predicted[m] is None]
        if unmeasured:
            return ModeChoice(unmeasured[0], "explore", full, delta)
        assert full is not None and delta is not None
        costs = {"full": full, "delta": delta}
        best, other = ("delta", "full") if delta < full else ("full", "delta")
        reason = "cheaper"
        incumbent = self._incumbent
        if incumbent == other and costs[best] > (1 - self.switch_margin) * costs[incumbent]:
            best, other, reason = other, best, "kept"  # not clearly cheaper: stay
        loss = abs(full - delta)
        warming = (other == self._cold_mode and self._seen[other] == 1
                   and min(full, delta) * self.warmup_factor >= max(full, delta))
        if warming or loss <= self.explore_budget * self._spent_since[other]:
            return ModeChoice(other, "explore", full, delta)
        self._incumbent = best
        refresh = best == "delta" or self._delta_may_follow(full, delta)
        return ModeChoice(best, reason, full, delta, refresh_snapshot=refresh)

    def _delta_may_follow(self, full: float, delta: float) -> bool:
        """After a full sync now, could the next sync be a delta (so the snapshot must be kept)?"""
        if (self._cold_mode == "delta" and self._seen["delta"] <= 1) or delta < full:
            return True  # still warming up, or cheaper already (kept out only by the switch margin)
        return abs(full - delta) <= self.explore_budget * (self._spent_since["delta"] + full)
