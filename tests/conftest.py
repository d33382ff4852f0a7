"""Shared fixtures. Ray is started with address="local" in a private temp dir, auth disabled, and
only the processes started here are ended (ray.shutdown on our own handle)."""

from __future__ import annotations

import os
import tempfile

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
