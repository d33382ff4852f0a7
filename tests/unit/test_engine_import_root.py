"""The engine's interpreter finds raygym, and only raygym, from the trainer's install: two virtual environments
made from one base Python share a binary, so "same interpreter" is decided by what each imports (its prefix).
Here raygym sits in a site-packages directory beside other packages (a non-editable install); another venv's
interpreter must get a path that holds raygym alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import raygym

pytestmark = pytest.mark.slow


def test_another_venv_of_the_same_base_python_gets_raygym_alone(tmp_path):
    site = tmp_path / "trainer-site-packages"
    shutil.copytree(Path(raygym.__file__).parent, site / "raygym", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "decoy_pkg").mkdir()
    (site / "decoy_pkg" / "__init__.py").write_text("raise ImportError('the trainer venv leaked into the engine')\n")
    venv.create(tmp_path / "engine-venv", with_pip=False, symlinks=True)
    engine_python = str(tmp_path / "engine-venv" / "bin" / "python")
    assert os.path.realpath(engine_python) == os.path.realpath(sys.executable)  # the case that fooled raygym

    ask = ("import json, sys; from raygym.engines.actor import raygym_import_root as r; "
           "print(json.dumps([r(sys.argv[1]), r(sys.executable)]))")
    done = subprocess.run([sys.executable, "-c", ask, engine_python], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr
    for_engine, for_itself = json.loads(done.stdout)
    assert sorted(os.listdir(for_engine)) == ["raygym"], os.listdir(for_engine)
    assert os.path.realpath(os.path.join(for_engine, "raygym")) == os.path.realpath(site / "raygym")
    assert Path(for_itself) == site  # the same interpreter imports from where this process does

    probe = ("import importlib.util as u, json; "
             "print(json.dumps([u.find_spec('raygym').origin, u.find_spec('decoy_pkg') is None]))")
    done = subprocess.run([engine_python, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": for_engine})
    assert done.returncode == 0, done.stderr
    origin, decoy_hidden = json.loads(done.stdout)
    assert origin.startswith(for_engine) and decoy_hidden
