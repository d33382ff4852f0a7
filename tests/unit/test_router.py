"""Router: least outstanding requests, round-robin ties, unhealthy engines get no traffic until re-synced."""

from __future__ import annotations

import random

import pytest

from raygym.engines.router import DEAD, HEALTHY, NEEDS_WEIGHTS, NoHealthyEngineError, Router
from raygym.errors import RaygymError


def test_ties_go_round_robin():
    r = Router(3)
    picks = []
    for _ in range(6):
        i = r.acquire()
        picks.append(i)
        r.release(i)
    assert picks == [0, 1, 2, 0, 1, 2]
    assert r.request_counts() == [2, 2, 2]


def test_least_outstanding_wins():
    r = Router(3)
    held = [r.acquire() for _ in range(3)]  # one request on each
    r.release(held[1])
    assert r.acquire() == 1
    r.release(0)
    r.release(2)
    assert r.acquire() in (0, 2)


def test_least_outstanding_invariant_under_random_traffic():
    rng = random.Random(0)
    r = Router(4)
    held: list[int] = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            r.release(held.pop(rng.randrange(len(held))))
            continue
        if rng.random() < 0.05:
            r.mark_unhealthy(rng.randrange(4))
        if rng.random() < 0.05:
            for i in range(4):
                if r.state(i) == DEAD:
                    r.mark_restarted(i)
                r.mark_ready(i, r.weight_version)
        healthy = r.healthy()
        if not healthy:
            with pytest.raises(NoHealthyEngineError):
                r.acquire()
            continue
        low = min(r.outstanding(i) for i in healthy)
        i = r.acquire()
        assert i in healthy and r.outstanding(i) == low + 1
        held.append(i)
    assert sum(r.outstanding(i) for i in range(4)) == len(held)


def test_unhealthy_engine_gets_no_traffic_until_restarted_and_current():
    r = Router(2, weight_version=3)
    r.mark_unhealthy(0)
    assert {r.acquire() for _ in range(4)} == {1}
    assert r.mark_ready(0, 3) is False  # dead: not restarted yet
    r.mark_restarted(0)
    assert r.state(0) == NEEDS_WEIGHTS and r.needing_weights() == [0]
    assert r.mark_ready(0, 2) is False  # stale weights
    r.set_weight_version(4)
    assert r.mark_ready(0, 3) is False
    assert r.mark_ready(0, 4) is True
    assert r.state(0) == HEALTHY and r.needing_weights() == []
    assert r.acquire() == 0  # it has the fewest outstanding requests now


def test_no_healthy_engine_and_exclude():
    r = Router(2)
    assert r.acquire(exclude={0}) == 1
    with pytest.raises(NoHealthyEngineError, match="excluded"):
        r.acquire(exclude={0, 1})
    r.mark_unhealthy(0)
    assert r.mark_unhealthy(0) is False  # already out
    r.mark_unhealthy(1)
    with pytest.raises(NoHealthyEngineError, match="no healthy rollout engine"):
        r.acquire()


def test_release_without_acquire_is_an_error():
    r = Router(1)
    with pytest.raises(RaygymError, match="without a matching acquire"):
        r.release(0)
    i = r.acquire()
    r.mark_unhealthy(i)
    r.release(i)  # in-flight requests of a dead engine still release
    assert r.outstanding(i) == 0


def test_reset_counts_and_bad_size():
    r = Router(2)
    r.release(r.acquire())
    r.reset_counts()
    assert r.request_counts() == [0, 0]
    with pytest.raises(ValueError):
        Router(0)
