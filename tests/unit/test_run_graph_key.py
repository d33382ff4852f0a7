"""The engine API key a run mints lives only as long as the run's graph: a later run, or a server a test
starts in the same process, must not inherit it (that is what made unrelated servers answer 401)."""

from __future__ import annotations

import os

import pytest

from raygym.config import Recipe
from raygym.graph import RunGraph
from raygym.rollout.auth import ENGINE_API_KEY_ENV


@pytest.mark.parametrize("minted", [True, False])
def test_shutdown_removes_only_a_key_the_graph_minted(monkeypatch, minted):
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "the-run-key")
    graph = RunGraph(Recipe(), minted_api_key=minted)
    graph.shutdown()  # nothing was started: only the environment is left to tidy
    assert (os.environ.get(ENGINE_API_KEY_ENV) is None) == minted
    graph.shutdown()  # idempotent
