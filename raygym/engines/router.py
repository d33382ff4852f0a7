"""Least-outstanding-requests routing over the rollout engines that serve the current policy (pure: no Ray,
no I/O).

The router knows the policy version the run serves (``weight_version``) and the version each engine holds.
Each engine is in one of four states:

- ``healthy``: in rotation; it holds the current version (every transition keeps this so);
- ``dead``: failed; gets no traffic while it is restarted;
- ``needs_weights``: its weights are behind: it was restarted (or replaced), or a weight sync did not reach
  it (:meth:`Router.apply_sync`); gets no traffic until a verified sync brings it to the CURRENT version
  (``apply_sync`` with it among the engines reached, or ``mark_ready(i, version)``);
- ``lost``: its actor is gone (e.g. its node died), so it cannot be restarted in place; gets no
  traffic until a new actor replaces it (``mark_restarted``), which then needs weights as above.

>>> r = Router(2)
>>> a = r.acquire(); b = r.acquire(); (a, b)
(0, 1)
>>> _ = r.mark_unhealthy(0); r.acquire()
1
>>> r.mark_restarted(0); r.mark_ready(0, weight_version=0)
True

A sync that reaches engine 0 only leaves engine 1 behind, out of rotation, until a sync reaches it:

>>> r.apply_sync(1, reached=[0])
[1]
>>> r.state(1), r.version(1), r.version(0)
('needs_weights', 0, 1)
>>> r.apply_sync(2, reached=[0, 1]), r.state(1), r.version(1)
([], 'healthy', 2)
"""

from __future__ import annotations

from collections.abc import Iterable

from raygym.errors import RaygymError

HEALTHY, DEAD, NEEDS_WEIGHTS, LOST = "healthy", "dead", "needs_weights", "lost"


class NoHealthyEngineError(RaygymError):
    """Every engine is dead or waiting for weights."""


class Router:
    """Picks the healthy engine with the fewest outstanding requests; ties go round-robin."""

    def __init__(self, num_engines: int, weight_version: int = 0) -> None:
        if num_engines <= 0:
            raise ValueError(f"num_engines={num_engines}: need at least one engine")
        self._state = [HEALTHY] * num_engines
        # the weight version each engine holds; None: unknown (a restarted server holds its checkpoint's)
        self._versions: list[int | None] = [weight_version] * num_engines
        self._outstanding = [0] * num_engines
        self._requests = [0] * num_engines  # total requests routed to each engine
        self._cursor = 0  # where the round-robin tie-break starts
        self.weight_version = weight_version

    @property
    def num_engines(self) -> int:
        return len(self._state)

    def state(self, i: int) -> str:
        return self._state[i]

    def version(self, i: int) -> int | None:
        """The weight version engine ``i`` holds (None: unknown since its restart)."""
        return self._versions[i]

    def outstanding(self, i: int) -> int:
        return self._outstanding[i]

    def request_counts(self) -> list[int]:
        """Requests routed to each engine since the last :meth:`reset_counts`."""
        return list(self._requests)

    def reset_counts(self) -> None:
        self._requests = [0] * len(self._state)

    def healthy(self) -> list[int]:
        """The engines in rotation."""
        return [i for i, s in enumerate(self._state) if s == HEALTHY]

    def needing_weights(self) -> list[int]:
        return [i for i, s in enumerate(self._state) if s == NEEDS_WEIGHTS]

    def acquire(self, exclude: frozenset[int] | set[int] = frozenset()) -> int:
        """Reserve a request slot on the best healthy engine (not in ``exclude``) and return its index.

        Raises :class:`NoHealthyEngineError` when there is none; pair every acquire with :meth:`release`."""
        n = len(self._state)
        best = -1
        for step in range(n):
            i = (self._cursor + step) % n
            if self._state[i] != HEALTHY or i in exclude:
                continue
            if best < 0 or self._outstanding[i] < self._outstanding[best]:
                best = i
        if best < 0:
            raise NoHealthyEngineError(
                f"no healthy rollout engine: states {dict(enumerate(self._state))}"
                + (f", excluded {sorted(exclude)}" if exclude else "")
            )
        self._outstanding[best] += 1
        self._requests[best] += 1
        self._cursor = (best + 1) % n
        return best

    def release(self, i: int) -> None:
        """End a request started with :meth:`acquire` (also after the engine was marked unhealthy)."""
        if self._outstanding[i] <= 0:
            raise RaygymError(f"router: release({i}) without a matching acquire")
        self._outstanding[i] -= 1

    def mark_unhealthy(self, i: int) -> bool:
        """Take engine ``i`` out of rotation; returns False if it already was."""
        if self._state[i] in (DEAD, LOST):
            return False
        self._state[i] = DEAD
        return True

    def mark_lost(self, i: int) -> None:
        """Engine ``i``'s actor is gone: out of rotation until a replacement is :meth:`mark_restarted`."""
        self._state[i] = LOST

    def mark_restarted(self, i: int) -> None:
        """Engine ``i`` is running again but must receive the current weights before traffic."""
        self._state[i] = NEEDS_WEIGHTS
        self._versions[i] = None

    def hold_back(self, engines: Iterable[int]) -> list[int]:
        """``engines`` did not get the weights a sync just pushed: those in rotation leave it (their weights are
        behind) until a sync reaches them. Returns the ones that left."""
        left = [i for i in sorted(set(engines)) if self._state[i] == HEALTHY]
        for i in left:
            self._state[i] = NEEDS_WEIGHTS
        return left

    def apply_sync(self, version: int, reached: Iterable[int]) -> list[int]:
        """A verified weight sync put ``version`` on the engines ``reached`` and it is now the policy version:
        they hold it (those waiting for weights return to rotation; a dead or lost one stays out), and every
        other engine in rotation whose weights are older leaves it until a sync reaches it. Returns the engines
        that left."""
        reached = set(reached)
        self.weight_version = version
        for i in reached:
            if self._state[i] in (DEAD, LOST):
                continue
            self._versions[i] = version
            self._state[i] = HEALTHY
        return self.hold_back(i for i, held in enumerate(self._versions) if i not in reached and held != version)

    def set_weight_version(self, version: int) -> None:
        """The policy version is ``version`` and every engine in rotation holds it (a caller that does not know
        which engines a sync reached; :meth:`apply_sync` when it does)."""
        self.weight_version = version
        for i in self.healthy():
            self._versions[i] = version

    def mark_ready(self, i: int, weight_version: int) -> bool:
        """Return engine ``i`` to rotation if it waits for weights and ``weight_version`` (what it holds now) is
        current.

        Returns False (and changes nothing) for a stale version or an engine that is dead or lost."""
        if weight_version != self.weight_version or self._state[i] in (DEAD, LOST):
            return False
        self._state[i] = HEALTHY
        self._versions[i] = weight_version
        return True
