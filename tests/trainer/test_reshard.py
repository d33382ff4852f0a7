"""Sharded checkpoints reshard: saved at 1 rank, loaded at 2 (FSDP2 shards for torch, tensor parallel for
Megatron) and saved again there, then loaded at 1 again: the tensors are the same bytes all the way, and the
next steps after the round trip are bit-identical to those of the rank that never left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_setup import MEGATRON, save_tiny_model, spawn_ranks

from raygym.checkpoint.store import latest_checkpoint, load_checkpoint

HERE = Path(__file__).resolve().parent


def same_tensors(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where


@pytest.mark.slow  # a separate process per rank
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["torch", MEGATRON])
def test_saved_at_one_rank_loads_at_two_and_back(backend, tmp_path):
    model = save_tiny_model("dense", tmp_path / "models")

    def phase(name: str, world: int) -> dict:
        spawn_ranks(str(HERE / "reshard_worker.py"),
                    ["--backend", backend, "--phase", name, "--model", model, "--dir", str(tmp_path)], world=world)
        return json.loads((tmp_path / f"{name}.json").read_text())

    first, reshard, back = phase("first", 1), phase("reshard", 2), phase("back", 1)
    a, b = latest_checkpoint(str(tmp_path / "a")), latest_checkpoint(str(tmp_path / "b"))
    assert a.manifest["world_size"] == 1 and b.manifest["world_size"] == 2
    assert len([f for f in b.manifest["files"] if f.endswith(".distcp")]) == 2  # each rank wrote its own shards
    ca, cb = load_checkpoint(a.path), load_checkpoint(b.path)
    same_tensors(ca.model_state, cb.model_state, "model")
    same_tensors(ca.optimizer_state["state"], cb.optimizer_state["state"], "optimizer")
    assert ca.trainer_state["schedule"] == cb.trainer_state["schedule"] == {"step": 2}

    # back at one rank: exactly the steps the first rank took after its own save
    assert back["steps"] == first["steps"]
    same_tensors(torch.load(tmp_path / "first.weights.pt"), torch.load(tmp_path / "back.weights.pt"), "weights")
    # at two ranks the same steps, up to the summation order of the sharded reductions
    for one, two in zip(first["steps"], reshard["steps"], strict=True):
        assert one.keys() == two.keys()
        for key in one:
            assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-5), key
