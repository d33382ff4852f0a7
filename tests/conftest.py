"""Shared fixtures. Ray is started with address="local" in a private temp dir, auth disabled, and
only the processes started here are ended (ray.shutdown on our own handle)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Short path: Ray's unix sockets must stay under the OS path limit.
_RAY_TMP = tempfile.mkdtemp(prefix="rg-", dir="/tmp")
os.environ.setdefault("RAY_TMPDIR", _RAY_TMP)


TESTS = Path(__file__).resolve().parent
# Whole training runs (the e2e marker): every test under these folders.
E2E_DIRS = ("e2e", "example_runs")
# raygym from its wheel in a fresh venv (the wheel marker): every test under this folder.
WHEEL_DIRS = ("wheel",)
# Tests that start Ray (the ray marker): these folders, and any test using these fixtures.
RAY_DIRS = ("ray",)
RAY_FIXTURES = ("ray_local",)
# Tests that start worker processes or servers, seconds each (the slow marker): these folders, any test
# using these fixtures, and the tests marked slow by hand (multi-rank torch worlds, CLI export).
SLOW_DIRS = ("rollout", "sandbox", "tasks", "weightsync")
SLOW_FIXTURES = ("contract_results",)


def pytest_collection_modifyitems(config, items):
    """Adds the markers that define the fast lane, by where a test lives and what it uses:

    - ``e2e`` to every test under tests/e2e and tests/example_runs (whole runs of the tiny model);
    - ``wheel`` to every test under tests/wheel (raygym installed from its wheel, run outside the checkout);
    - ``ray`` to every test under tests/ray and every test requesting the ``ray_local`` fixture;
    - ``slow`` to every test under tests/rollout (HTTP engine servers), tests/sandbox (sandboxed
      processes), tests/tasks (an engine server per module), tests/weightsync (gloo groups across
      processes) and every test requesting ``contract_results`` (a trainer worker process per backend).

    Markers set in the test files are kept; the fast lane is
    ``pytest -m "not e2e and not ray and not slow and not gpu and not sglang and not megatron and not
    modal and not sglang_cpu and not vllm_cpu and not wheel"``.
    """
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if not path.is_relative_to(TESTS):  # raygym/'s doctests: pure, in every lane
            continue
        folder = path.relative_to(TESTS).parts[0]
        fixtures = set(getattr(item, "fixturenames", ()))
        if folder in E2E_DIRS:
            item.add_marker(pytest.mark.e2e)
        if folder in WHEEL_DIRS:
            item.add_marker(pytest.mark.wheel)
        if folder in RAY_DIRS or fixtures & set(RAY_FIXTURES):
            item.add_marker(pytest.mark.ray)
        if folder in SLOW_DIRS or fixtures & set(SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)


def start_local_ray(num_cpus: int = 8, num_gpus: int = 8, **kwargs):
    """Start (or reuse) a private local Ray with logical GPUs; returns the ray module."""
    import ray

    if ray.is_initialized():
        res = ray.cluster_resources()
        if res.get("GPU", 0) == num_gpus and res.get("CPU", 0) == num_cpus and not kwargs:
            return ray
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=True,
        _temp_dir=os.environ["RAY_TMPDIR"],
        **kwargs,
    )
    return ray


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's in-process reference forwards (``pytest.mark.usefixtures``): on a shared
    2-core box spinning threads cost 10x."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray with 8 logical CPUs and 8 logical GPUs shared by the tests of a session."""
    ray = start_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny random Qwen3 checkpoint with the builtin character tokenizer (no downloads)."""
    from raygym.builtin import TINY_MODEL, materialize_model

    return materialize_model(TINY_MODEL, tmp_path_factory.mktemp("models"), seed=0)
