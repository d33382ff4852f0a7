"""Weight verification catches one wrong tensor on raygym's server: its exact checksums see a tensor
left stale or scaled by 1.01 in the engine, and many correct syncs raise no false alarm; the calibrated
log-prob probe (what stock engines rely on, run here against raygym's server, the fastest real engine) catches
the same faults sent by the trainer, which no checksum of what was sent can see."""

from __future__ import annotations

import time

import pytest
import torch

from raygym.config import Recipe
from raygym.errors import WeightSyncError
from raygym.weightsync.coordinator import WeightSync
from tests.weightsync.faults import (
    ATTENTION_TENSOR,
    FAULTS,
    MLP_TENSOR,
    FaultyTrainer,
    TamperingLink,
    syncs_without_false_alarm,
)
from tests.weightsync.raygym_servers import raygym_servers


def recipe(**over) -> Recipe:
    fields = dict(update_weight_transport="nccl", update_weight_mode="delta", update_weight_buffer_size=64 * 1024,
                  update_weight_timeout=30.0, colocate=False)
    fields.update(over)
    return Recipe(**fields)


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    """One float32 and one bfloat16 raygym server, for every test here."""
    with raygym_servers(tiny_model_path, 1, "float32") as fp32, raygym_servers(tiny_model_path, 1, "bfloat16") as bf16:
        yield {"float32": fp32[0], "bfloat16": bf16[0]}


@pytest.fixture(autouse=True)
def one_thread():
    """The trainer's forward passes on one thread: the servers hold the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_sync(url, trainer, *, probe: bool = False, cast_dtype: str | None = None, **over) -> tuple[WeightSync, TamperingLink]:
    link = TamperingLink(url, trainer, dtype=torch.bfloat16 if cast_dtype else torch.float32)
    sync = WeightSync(recipe(**over), [trainer], [link],
                      spec_overrides={"master_address": "127.0.0.1", "backend": "gloo", "cast_dtype": cast_dtype})
    if probe:
        sync.verification = "probe"  # as for stock SGLang: the version label, then the calibrated probe
    sync.setup()
    return sync, link


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", [MLP_TENSOR, ATTENTION_TENSOR])
def test_checksums_catch_one_wrong_tensor_in_the_engine(servers, tiny_model_path, fault, name):
    trainer = FaultyTrainer(tiny_model_path, lr=1e-5)  # small steps: a stale tensor is close to the right one
    sync, link = make_sync(servers["float32"], trainer)
    try:
        sync.push(1)
        trainer.arm(name, fault)
        trainer.disarm()  # the trainer sends the right tensor; the engine ends up with a wrong one
        link.armed = (name, fault)
        with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) differ \['" + name):
            sync.push(2)
        assert link.tampered == 2 and sync.full_resyncs == 1  # the full resync was tampered with too
        link.armed = None
        assert sync.push(3)["sync/verified_tensors"] == len(list(trainer.hf_weights()))
    finally:
        sync.shutdown()


def test_checksums_catch_a_tensor_the_sync_left_out(servers, tiny_model_path):
    """The trainer trains, then pushes every tensor but one: it vouches only for what it sent, so the engine's
    stale copy of the one left out must show as a tensor the sync did not cover."""
    trainer = FaultyTrainer(tiny_model_path, lr=1e-3)
    sync, _ = make_sync(servers["float32"], trainer, update_weight_mode="full")
    try:
        sync.push(1)
        trainer.arm(MLP_TENSOR, "omitted")
        with pytest.raises(WeightSyncError, match=r"1 not covered by the sync \['" + MLP_TENSOR):
            sync.push(2)
        trainer.disarm()
        assert sync.push(3)["sync/verified_tensors"] == len(list(trainer.hf_weights()))
    finally:
        sync.shutdown()


def test_two_hundred_checksum_syncs_raise_no_false_alarm(servers, tiny_model_path):
    trainer = FaultyTrainer(tiny_model_path, lr=1e-3)
    sync, _ = make_sync(servers["float32"], trainer, update_weight_mode="auto")
    start = time.monotonic()
    try:
        history = syncs_without_false_alarm(sync, trainer, 1, 200)
    finally:
        sync.shutdown()
    assert {m["sync/mode"] for m in history} >= {0.0}
    assert all(m["sync/verified_tensors"] == 25 for m in history)
    print(f"200 checksum syncs in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("fault", FAULTS)
def test_the_calibrated_probe_catches_one_wrong_tensor_the_trainer_sends(servers, tiny_model_path, fault):
    """The engine holds what it was sent, so checksums agree; the trainer's forward pass does not. (A step of
    1e-3: a tensor one step stale differs from the right one by ~1e-3 per element.)"""
    trainer = FaultyTrainer(tiny_model_path, lr=1e-3)
    sync, _ = make_sync(servers["float32"], trainer, probe=True)
    try:
        first = sync.push(1)
        assert sync.calibration is not None and first["sync/probe_floor_max"] < 1e-5  # float32: the same kernels
        assert first["sync/probe_tokens"] >= 200
        syncs_without_false_alarm(sync, trainer, 2, 3)
        trainer.arm(MLP_TENSOR, fault)
        with pytest.raises(WeightSyncError, match="probe log-probs differ"):
            sync.push(5)
        trainer.disarm()
        assert sync.push(6)["sync/resynced"] == 0.0
    finally:
        sync.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_calibrated_probe_raises_no_false_alarm(servers, tiny_model_path, dtype):
    """A learning rate that moves the model far (the log-probs of the probe change by ~0.1 a sync), bf16
    payloads for the bf16 engine: the tolerance calibrated at the first sync holds for every later one."""
    trainer = FaultyTrainer(tiny_model_path, lr=1e-2)
    sync, _ = make_sync(servers[dtype], trainer, probe=True, update_weight_mode="full",
                        cast_dtype="bfloat16" if dtype == "bfloat16" else None)
    start = time.monotonic()
    try:
        first = sync.push(1)
        history = syncs_without_false_alarm(sync, trainer, 2, 199)
    finally:
        sync.shutdown()
    margins = [m["sync/probe_margin"] for m in history]
    print(f"{dtype}: floor {first['sync/probe_floor_mean']:.2e} / {first['sync/probe_floor_max']:.2e}, "
          f"worst margin {max(margins):.2f}, {len(history)} syncs in {time.monotonic() - start:.1f} s")
    assert max(margins) <= 1.0
