"""The sharded checkpoint format (one process here; several ranks in tests/trainer/test_reshard.py)."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from raygym.checkpoint.sharded import FORMAT_SHARDED, fill_from_full, load_sharded, save_sharded
from raygym.checkpoint.state import CheckpointState
from raygym.checkpoint.store import capture_rng_state, latest_checkpoint, load_checkpoint
from raygym.checkpoint.tensor_shard import TensorShard


@pytest.fixture(params=["local", "memory"])
def ckpt_dir(request, tmp_path) -> str:
    return str(tmp_path / "ckpt") if request.param == "local" else f"memory://raygym-sharded-{uuid.uuid4().hex}"


def state(scale: float) -> CheckpointState:
    return CheckpointState(
        model={"w": torch.arange(6.0).reshape(2, 3) * scale, "b": torch.full((3,), scale)},
        optimizer={"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2, 3) * scale}}},
        schedule={"step": 2},
        rng=capture_rng_state(),
    )


def zeros_like(s: CheckpointState) -> CheckpointState:
    return CheckpointState(model={k: torch.zeros_like(v) for k, v in s.model.items()},
                           optimizer={"state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(2, 3)}}})


def test_round_trip_manifest_last_and_whole_read(ckpt_dir):
    saved = state(3.0)
    url = save_sharded(ckpt_dir, 7, saved, rank=0, world_size=1, extra={"data": 1})
    info = latest_checkpoint(ckpt_dir)
    assert info.rollout_id == 7 and info.manifest["format"] == FORMAT_SHARDED and info.manifest["has_optimizer"]
    assert {"dcp/.metadata", "trainer_state/rank_00000.pt", "extra.json"} <= set(info.manifest["files"])
    loaded = load_sharded(url, zeros_like(saved), rank=0, world_size=1)
    assert torch.equal(loaded.model["w"], saved.model["w"]) and torch.equal(loaded.model["b"], saved.model["b"])
    assert torch.equal(loaded.optimizer["state"]["w"]["exp_avg"], saved.optimizer["state"]["w"]["exp_avg"])
    assert loaded.schedule == {"step": 2} and torch.equal(loaded.rng["torch"], saved.rng["torch"])
    whole = load_checkpoint(url)
    assert whole.extra == {"data": 1} and torch.equal(whole.model_state["w"], saved.model["w"])
    assert torch.equal(whole.optimizer_state["state"]["w"]["step"], torch.tensor(2.0))
    assert load_checkpoint(url, load_optimizer=False).optimizer_state is None


def test_an_uncommitted_checkpoint_does_not_count_until_committed(ckpt_dir):
    from raygym.checkpoint.files import commit_manifest

    save_sharded(ckpt_dir, 3, state(1.0), rank=0, world_size=1)
    url = save_sharded(ckpt_dir, 6, state(2.0), rank=0, world_size=1, commit=False)
    assert latest_checkpoint(ckpt_dir).rollout_id == 3  # step 6's files are all there, its manifest pending
    assert commit_manifest(url) and not commit_manifest(url)
    info = latest_checkpoint(ckpt_dir)
    assert info.rollout_id == 6 and "manifest.pending.json" not in info.manifest["files"]
    assert torch.equal(load_checkpoint(info.path).model_state["b"], torch.full((3,), 2.0))
    # saved again (a resumed run redoing the step): the old pending manifest goes with the old files
    save_sharded(ckpt_dir, 6, state(4.0), rank=0, world_size=1, commit=False)
    assert latest_checkpoint(ckpt_dir).rollout_id == 3


def test_weights_only_checkpoint_loads_without_optimizer(ckpt_dir):
    saved = state(1.0)
    saved.optimizer = None  # no_save_optim
    url = save_sharded(ckpt_dir, 0, saved, rank=0, world_size=1)
    assert not latest_checkpoint(ckpt_dir).manifest["has_optimizer"]
    loaded = load_sharded(url, zeros_like(state(1.0)), rank=0, world_size=1)
    assert loaded.optimizer is None and torch.equal(loaded.model["b"], torch.ones(3))


def test_overwrite_and_a_damaged_shard_make_an_incomplete_checkpoint(tmp_path):
    save_sharded(str(tmp_path), 1, state(1.0), rank=0, world_size=1)
    url = save_sharded(str(tmp_path), 2, state(2.0), rank=0, world_size=1)
    save_sharded(str(tmp_path), 2, state(5.0), rank=0, world_size=1)  # overwritten in place
    assert torch.equal(load_checkpoint(url).model_state["b"], torch.full((3,), 5.0))
    fs = fsspec.filesystem("file")
    shard = next(p for p in fs.find(url) if p.endswith(".distcp"))
    with open(shard, "ab") as f:
        f.write(b"x")  # a shard that no longer matches the manifest
    assert latest_checkpoint(str(tmp_path)).rollout_id == 1


def test_tensor_shard_blocks_fill_from_a_full_state():
    full = torch.arange(12.0).reshape(4, 3)
    block = TensorShard(torch.zeros(2, 3), offsets=(2, 0), global_shape=(4, 3))
    template = {"model": {"w": block, "b": torch.zeros(3)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    fill_from_full(template, {"model": {"w": full, "b": torch.ones(3)}})
    assert torch.equal(block.local, full[2:]) and torch.equal(template["model"]["b"], torch.ones(3))
    missing = []
    fill_from_full({"x": torch.zeros(1)}, {}, missing.append)
    assert missing == ["x"]
    with pytest.raises(ValueError, match="exceeds"):
        TensorShard(torch.zeros(3, 3), offsets=(2, 0), global_shape=(4, 3))
    with pytest.raises(NotImplementedError):
        block + 1
