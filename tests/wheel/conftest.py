"""raygym as users install it: an interpreter with raygym from its wheel in a fresh venv, and a working directory
outside the checkout, so nothing is imported from the source tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine_training import installed_raygym_python


@pytest.fixture(scope="session")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The installed interpreter (``RAYGYM_WHEEL_PYTHON``, else a venv built now from this checkout's wheel)."""
    return installed_raygym_python(tmp_path_factory.mktemp("wheel-venv"))


@pytest.fixture
def user_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH into the checkout, no Ray address, auth off, a private
    Ray temp dir (short: Ray's socket paths have a length limit)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    env.pop("RAY_ADDRESS", None)
    ray_tmp = Path("/tmp") / f"rgw-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**6}"
    ray_tmp.mkdir(exist_ok=True)
    env["RAY_TMPDIR"] = str(ray_tmp)
    return env
