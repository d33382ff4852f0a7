"""Offline checks of the Modal app object (no credentials, no network); real runs are marked `modal`."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
from pathlib import Path

import pytest

modal = pytest.importorskip(
    "modal", reason="modal is not installed (pip install modal); it is not a dev dependency"
)

from raygym.errors import ConfigError  # noqa: E402
from raygym.launchers.modal_app import CHECKPOINTS_DIR, DATA_DIR, HF_CACHE_DIR, build_app, main, run_cluster  # noqa: E402
from raygym.launchers.modal_config import ModalConfig  # noqa: E402
from raygym.presets import qwen3_4b  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_single_node_preset_function_spec():
    run = build_app(["--preset", "qwen3-4b"])
    info = run.train_fn.info()
    recipe = qwen3_4b()
    assert info.gpus == [("H100", recipe.actor_num_gpus_per_node)]
    assert info.cluster_info.size == recipe.total_nodes() == 1
    assert info.cluster_info.rdma is False
    assert info.timeout == 24 * 3600
    assert set(info.volumes) == {HF_CACHE_DIR, DATA_DIR, CHECKPOINTS_DIR}
    assert {v.name for v in info.volumes.values()} == {"raygym-hf-cache", "raygym-data", "raygym-checkpoints"}
    assert any("wandb-secret" in s for s in info.secrets) and any(
        "huggingface-secret" in s for s in info.secrets
    )
    assert run.launch.app_name == "raygym-qwen3-4b" and run.launch.train_args == ["--preset", "qwen3-4b"]


def test_multi_node_cluster_uses_rdma_and_modal_flags():
    run = build_app(
        ["--preset", "qwen3-4b", "--actor-num-nodes", "2", "--modal-gpu-type", "H200", "--modal-memory", "[65536, 131072]",
         "--modal-region", "us-east", "--modal-timeout-s", "7200", "--num-rollout", "3"]
    )  # fmt: skip
    info = run.train_fn.info()
    assert run.launch.total_nodes == 2
    assert info.cluster_info.size == 2 and info.cluster_info.rdma is True
    assert info.gpus == [("H200", 8)] and info.memory_mib == (65536, 131072)
    assert info.regions == ["us-east"] and info.timeout == 7200
    assert run.launch.train_args == ["--preset", "qwen3-4b", "--actor-num-nodes", "2", "--num-rollout", "3"]


def test_explicit_config_with_extra_function_kwargs():
    cfg = ModalConfig(
        name="my-run", secrets=[], app_tags={"team": "rl"}, train_function_kwargs={"retries": 0}, cpu=16.0
    )
    run = build_app(["--preset", "qwen3-4b"], cfg)
    info = run.train_fn.info()
    assert run.launch.app_name == "my-run" and info.cpu == 16.0
    assert not any("secret" in s and "from_name" in s for s in info.secrets)


def test_local_overlay_must_be_a_checkout(tmp_path):
    build_app(["--preset", "qwen3-4b"], ModalConfig(local_raygym=str(REPO)))
    with pytest.raises(ConfigError, match="local_raygym"):
        build_app(["--preset", "qwen3-4b"], ModalConfig(local_raygym=str(tmp_path)))


def test_entrypoint_takes_raw_flags_and_container_function_is_global():
    assert [p.kind for p in inspect.signature(main.info.raw_f).parameters.values()] == [
        inspect.Parameter.VAR_POSITIONAL
    ]
    assert run_cluster.__qualname__ == "run_cluster"  # Modal re-imports it by name inside containers


@pytest.mark.modal
@pytest.mark.timeout(3600)
def test_real_run_on_modal():
    if not (os.environ.get("MODAL_TOKEN_ID") or Path("~/.modal.toml").expanduser().exists()):
        pytest.skip("no Modal credentials (MODAL_TOKEN_ID or ~/.modal.toml)")
    modal_cli = shutil.which("modal")
    assert modal_cli, "modal CLI not on PATH"
    proc = subprocess.run(
        [modal_cli, "run", "-m", "raygym.launchers.modal_app", "--preset", "qwen3-0.6b", "--num-rollout", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=3500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert '"status": "SUCCEEDED"' in proc.stdout
