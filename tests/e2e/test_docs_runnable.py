"""The docs' runnable commands, run as a user would: every ```bash runnable block of README.md and docs/*.md.

One test per page: its commands run in the order a reader meets them, each as its own process, in a fresh
directory that holds the checkout's files (links to them, so ``tests/fixtures/...`` and ``examples/...``
resolve, while ``runs/``, ``models/`` and the like are the page's own). Each gets a private ``RAY_TMPDIR``,
``RAY_AUTH_MODE=disabled`` and no ``RAY_ADDRESS``; ``raygym`` runs as ``python -m raygym`` with this checkout
on ``PYTHONPATH`` (the installed package). Every command must exit 0 within its timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.doc_blocks import REPO_ROOT, doc_files, page_commands

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

COMMAND_TIMEOUT_S = 300
PAGES = [p for p in doc_files() if page_commands(p)]


def checkout_view(into: Path) -> None:
    """Link the checkout's tracked top-level files and folders into the directory ``into``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    tops = sorted({name.split("/", 1)[0] for name in listed.decode().split("\0") if name})
    for top in tops:
        if (REPO_ROOT / top).exists():
            (into / top).symlink_to(REPO_ROOT / top)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_page_commands_run(page, tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    checkout_view(cwd)
    ray_tmp = tempfile.mkdtemp(prefix="rgdoc-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)
    commands = page_commands(page)
    try:
        for command in commands:
            done = subprocess.run(command.argv(sys.executable), cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=COMMAND_TIMEOUT_S)
            printed = (done.stdout + done.stderr)[-4000:]
            assert done.returncode == 0, f"{command.where}: {command.text}\nexit {done.returncode}\n{printed}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
