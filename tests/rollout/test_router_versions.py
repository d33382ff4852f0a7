"""Router with per-engine weight versions: the router knows the policy version and what each engine holds; an
engine a verified sync did not reach gets no traffic until a sync reaches it (pure, no I/O)."""

from __future__ import annotations

import pytest

from raygym.engines.router import DEAD, HEALTHY, LOST, NEEDS_WEIGHTS, NoHealthyEngineError, Router


def routed(r: Router, n: int) -> set[int]:
    """The engines ``n`` requests (each released at once) go to."""
    picks = set()
    for _ in range(n):
        i = r.acquire()
        picks.add(i)
        r.release(i)
    return picks


def test_each_engine_has_its_own_version() -> None:
    r = Router(3, weight_version=4)
    assert [r.version(i) for i in range(3)] == [4, 4, 4]
    assert r.apply_sync(5, reached=[0, 1, 2]) == []
    assert r.weight_version == 5 and [r.version(i) for i in range(3)] == [5, 5, 5]
    assert r.apply_sync(6, reached=[0, 2]) == [1]
    assert [r.version(i) for i in range(3)] == [6, 5, 6]  # engine 1 still holds 5, not labelled 6
    r.mark_restarted(2)
    assert r.version(2) is None  # a restarted server holds its checkpoint's weights, not a synced version


def test_an_engine_the_sync_missed_gets_no_traffic() -> None:
    r = Router(2, weight_version=0)
    assert routed(r, 4) == {0, 1}
    assert r.apply_sync(1, reached=[0]) == [1]
    assert r.state(1) == NEEDS_WEIGHTS and r.needing_weights() == [1]
    assert routed(r, 6) == {0}
    r.set_weight_version(1)  # what a caller that does not know the sync's engines says: it stamps only rotation
    assert r.version(1) == 0 and routed(r, 4) == {0}
    assert r.mark_ready(1, 0) is False  # old weights: stays out
    assert r.apply_sync(1, reached=[0]) == [] and routed(r, 4) == {0}  # published again without it: still out


def test_it_returns_when_a_sync_reaches_it() -> None:
    r = Router(2)
    r.apply_sync(1, reached=[0])
    assert r.apply_sync(2, reached=[0, 1]) == []
    assert r.state(1) == HEALTHY and r.version(1) == 2
    assert routed(r, 4) == {0, 1}
    # or the driver reports it pushed the current version to it alone
    r.apply_sync(3, reached=[1])
    assert routed(r, 4) == {1}
    assert r.mark_ready(0, 3) is True and routed(r, 4) == {0, 1}


def test_hold_back_before_publish_and_the_other_states() -> None:
    r = Router(3)
    r.mark_unhealthy(1)
    r.mark_lost(2)
    assert r.hold_back([0, 1, 2]) == [0]  # only an engine in rotation leaves it; dead and lost stay as they are
    assert (r.state(0), r.state(1), r.state(2)) == (NEEDS_WEIGHTS, DEAD, LOST)
    with pytest.raises(NoHealthyEngineError):
        r.acquire()
    # a dead or lost engine the sync happened to reach does not come back: it must be restarted or replaced
    assert r.apply_sync(1, reached=[0, 1, 2]) == []
    assert (r.state(0), r.state(1), r.state(2)) == (HEALTHY, DEAD, LOST)
    r.mark_restarted(1)
    assert r.apply_sync(2, reached=[0, 1]) == [] and routed(r, 4) == {0, 1}


def test_an_engine_already_on_the_version_is_not_held_back() -> None:
    r = Router(2)
    r.apply_sync(1, reached=[0, 1])
    assert r.apply_sync(1, reached=[0]) == []  # engine 1 holds 1 already: nothing missed
    assert routed(r, 4) == {0, 1}
