"""Least-outstanding-requests routing over the healthy rollout engines (pure: no Ray, no I/O).

Each engine is in one of three states:

- ``healthy``: gets traffic;
- ``dead``: failed; gets no traffic while it is restarted;
- ``needs_weights``: restarted, but it serves stale weights; gets no traffic until
  ``mark_ready(i, version)`` reports the CURRENT weight version (a recovered engine
  must not serve before it holds the current policy);
- ``lost``: its actor is gone (e.g. its node died), so it cannot be restarted in place; gets no
  traffic until a new actor replaces it (``mark_restarted``), which then needs weights as above.

>>> r = Router(2)
>>> a = r.acquire(); b = r.acquire(); (a, b)
(0, 1)
>>> _ = r.mark_unhealthy(0); r.acquire()
1
>>> r.mark_restarted(0); r.mark_ready(0, weight_version=0)
True
"""

from __future__ import annotations

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
        self._outstanding = [0] * num_engines
        self._requests = [0] * num_engines  # total requests routed to each engine
        self._cursor = 0  # where the round-robin tie-break starts
        self.weight_version = weight_version

    @property
    def num_engines(self) -> int:
        return len(self._state)

    def state(self, i: int) -> str:
        return self._state[i]

    def outstanding(self, i: int) -> int:
        return self._outstanding[i]

    def request_counts(self) -> list[int]:
        """Requests routed to each engine since the last :meth:`reset_counts`."""
        return list(self._requests)

    def reset_counts(self) -> None:
        self._requests = [0] * len(self._state)

    def healthy(self) -> list[int]:
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

    def set_weight_version(self, version: int) -> None:
        """The policy version every serving engine holds now (after a weight sync)."""
        self.weight_version = version

    def mark_ready(self, i: int, weight_version: int) -> bool:
        """Return engine ``i`` to rotation if it was restarted and holds the current weight version.

        Returns False (and changes nothing) for a stale version or an engine that was not restarted."""
        if weight_version != self.weight_version or self._state[i] in (DEAD, LOST):
            return False
        self._state[i] = HEALTHY
        return True
