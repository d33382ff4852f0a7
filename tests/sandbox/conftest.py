"""Fixtures of the sandbox tests: ``backend`` is every isolating backend that works here, each forced
by name; ``box`` is a sandbox on it."""

from __future__ import annotations

import os

import pytest

from raygym.sandbox import Sandbox
from raygym.sandbox.process import processes_of
from tests.sandbox.hostile import FAST, working_backends

BACKENDS = working_backends()


@pytest.fixture(params=BACKENDS or [pytest.param(None, marks=pytest.mark.skip(reason="no sandbox backend works here"))])
def backend(request) -> str:
    return request.param


@pytest.fixture
def box(backend):
    with Sandbox(FAST, backend=backend) as sandbox:
        yield sandbox
        if os.geteuid() == 0:  # its own uids: nothing a run started outlives it
            assert processes_of(sandbox.uid, sandbox.grader_uid) == []
