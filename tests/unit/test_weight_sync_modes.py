"""update_weight_mode='auto' and update_weight_double_buffer: what the config accepts, and that auto only
ever chooses among the payloads the engine kind can receive over the configured transport."""

from __future__ import annotations

import pytest

from raygym import ConfigError, Recipe
from raygym.engine_api.kinds import check_weight_sync, payload_modes
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.sender import SenderSpec


def test_auto_is_a_valid_mode_also_colocated():
    assert Recipe(update_weight_mode="auto", colocate=False, rollout_num_gpus=8).update_weight_mode == "auto"
    assert Recipe(update_weight_mode="auto", colocate=True).update_weight_mode == "auto"  # full only there


@pytest.mark.parametrize("kind, transport, colocate, modes", [
    ("raygym", "nccl", False, ("full", "delta")),
    ("raygym", "disk", False, ("full", "delta")),
    ("raygym", "nccl", True, ("full",)),
    ("raygym", "ipc", True, ("full",)),
    ("sglang", "nccl", False, ("full",)),
    ("sglang", "disk", False, ("full", "delta")),
    ("sglang", "ipc", True, ("full",)),
])
def test_auto_chooses_only_what_the_engine_can_receive(kind, transport, colocate, modes):
    assert payload_modes(kind, transport=transport, colocate=colocate) == modes
    check_weight_sync(kind, mode="auto", transport=transport, colocate=colocate)  # never refused
    spec = SenderSpec(engines=["http://127.0.0.1:1"], transport=transport, mode="auto", engine_kind=kind,
                      colocate=colocate, disk_dir="/shared" if transport == "disk" else "")
    assert spec.payload_modes == modes
    assert spec.keeps_snapshot == ("delta" in modes)


def test_auto_on_stock_sglang_over_nccl_sends_sglang_format_and_never_deltas():
    recipe = Recipe(update_weight_mode="auto", colocate=False, rollout_num_gpus=8, rollout_engine="sglang")
    sync = WeightSync(recipe, [object()], ["http://127.0.0.1:1"], engine_kind="sglang")
    assert sync.spec.hf_tensors  # flattened_bucket: full HF tensors only
    assert sync.cost_model is not None and sync.cost_model.modes == ("full",)
    disk = WeightSync(Recipe(update_weight_mode="auto", update_weight_transport="disk", update_weight_disk_dir="/s",
                             colocate=False, rollout_num_gpus=8), [object()], ["http://127.0.0.1:1"], engine_kind="sglang")
    assert disk.spec.disk_route == "tensor_pointer" and disk.cost_model.modes == ("full", "delta")


def test_fixed_modes_have_no_cost_model():
    for mode in ("full", "delta"):
        sync = WeightSync(Recipe(update_weight_mode=mode, colocate=False, rollout_num_gpus=8), [object()],
                          ["http://127.0.0.1:1"])
        assert sync.cost_model is None


def test_double_buffer_needs_an_engine_that_can_and_no_colocation():
    ok = Recipe(update_weight_double_buffer=True, colocate=False, rollout_num_gpus=8, rollout_engine="raygym")
    assert ok.update_weight_double_buffer
    with pytest.raises(ConfigError, match="update_weight_double_buffer.*colocate"):
        Recipe(update_weight_double_buffer=True, colocate=True)
    with pytest.raises(ConfigError, match="update_weight_double_buffer.*sglang"):
        Recipe(update_weight_double_buffer=True, colocate=False, rollout_num_gpus=8, rollout_engine="sglang")
    sync = WeightSync(ok, [object()], ["http://127.0.0.1:1"])
    assert sync.double_buffer
