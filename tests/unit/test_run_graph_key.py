"""The engine API key a run mints lives only as long as the run's graph: a later run, or a server a test
starts in the same process, must not inherit it (that is what made unrelated servers answer 401)."""

from __future__ import annotations

import os

import pytest

from raygym.engine_api.auth import ENGINE_API_KEY_ENV
from raygym.run.graph import end_run


@pytest.mark.parametrize("minted", [True, False])
def test_shutdown_removes_only_a_key_the_graph_minted(monkeypatch, minted):
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "the-run-key")
    end_run(False, minted_api_key=minted)  # what RunGraph.shutdown and a failed build_graph call
    assert (os.environ.get(ENGINE_API_KEY_ENV) is None) == minted  # nothing was started: only the key to tidy
    end_run(False, minted_api_key=minted)  # again: nothing to do
    assert (os.environ.get(ENGINE_API_KEY_ENV) is None) == minted
