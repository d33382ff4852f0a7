"""Checkpoint files through fsspec: manifest last, incomplete ones skipped, resume semantics, RNG."""

from __future__ import annotations

import logging
import os
import random
import uuid

import fsspec
import pytest
import torch

from raygym.checkpoint.store import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_start_rollout_id,
    restore_rng_state,
    save_checkpoint,
)
from raygym.errors import ConfigError


@pytest.fixture(params=["local", "memory"])
def ckpt_dir(request, tmp_path) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else f"memory://raygym-test-{uuid.uuid4().hex}"


def _state(step: float) -> dict:
    return {"w": torch.full((3,), step), "b": torch.arange(4)}


def test_save_load_round_trip(ckpt_dir):
    optim = {
        "state": {"w": {"exp_avg": torch.ones(3), "step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    path = save_checkpoint(
        ckpt_dir,
        5,
        model_state=_state(5),
        optimizer_state=optim,
        trainer_state={"schedule": {"step": 2}},
        extra={"data": {"epoch": 1, "offset": 40}},
    )
    assert path.rstrip("/").endswith("iter_0000005")
    info = latest_checkpoint(ckpt_dir)
    assert info.rollout_id == 5 and info.manifest["has_optimizer"]
    ckpt = load_checkpoint(info.path)
    assert torch.equal(ckpt.model_state["w"], torch.full((3,), 5.0))
    assert torch.equal(ckpt.optimizer_state["state"]["w"]["exp_avg"], torch.ones(3))
    assert ckpt.trainer_state == {"schedule": {"step": 2}} and ckpt.extra == {
        "data": {"epoch": 1, "offset": 40}
    }
    assert load_checkpoint(info.path, load_optimizer=False).optimizer_state is None  # no_load_optim


def test_no_save_optim(ckpt_dir):
    save_checkpoint(ckpt_dir, 1, model_state=_state(1))
    info = latest_checkpoint(ckpt_dir)
    assert not info.manifest["has_optimizer"] and load_checkpoint(info.path).optimizer_state is None


def test_newest_complete_wins_and_half_written_is_ignored(ckpt_dir, caplog):
    save_checkpoint(ckpt_dir, 2, model_state=_state(2))
    save_checkpoint(ckpt_dir, 10, model_state=_state(10))
    fs, root = fsspec.core.url_to_fs(ckpt_dir)
    # a crash after model.pt but before the manifest
    fs.makedirs(f"{root}/iter_0000011", exist_ok=True)
    with fs.open(f"{root}/iter_0000011/model.pt", "wb") as f:
        torch.save(_state(11), f)
    # a manifest whose file was truncated afterwards
    save_checkpoint(ckpt_dir, 12, model_state=_state(12))
    with fs.open(f"{root}/iter_0000012/model.pt", "wb") as f:
        f.write(b"trunc")
    with caplog.at_level(logging.WARNING, logger="raygym.checkpoint.store"):
        info = latest_checkpoint(ckpt_dir)
    assert info.rollout_id == 10
    assert [c.rollout_id for c in list_checkpoints(ckpt_dir)] == [2, 10]
    assert "iter_0000011" in caplog.text and "iter_0000012" in caplog.text
    with pytest.raises(ConfigError, match="not a complete"):
        load_checkpoint(f"{ckpt_dir.rstrip('/')}/iter_0000011")


def test_local_manifest_is_renamed_into_place(tmp_path):
    save_checkpoint(str(tmp_path), 0, model_state=_state(0))
    names = os.listdir(tmp_path / "iter_0000000")
    assert "manifest.json" in names and not [n for n in names if ".tmp" in n]


def test_empty_or_missing_dir_has_no_checkpoint(tmp_path):
    assert latest_checkpoint(str(tmp_path / "nothing")) is None
    assert latest_checkpoint(f"memory://raygym-empty-{uuid.uuid4().hex}") is None


def test_start_rollout_id_semantics():
    assert resolve_start_rollout_id(None, None) == 0
    assert resolve_start_rollout_id(None, 7) == 8  # continue after the stored step
    assert resolve_start_rollout_id(0, 7) == 0  # explicit value wins


def test_rng_state_round_trip():
    import numpy as np

    state = capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_state(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]
