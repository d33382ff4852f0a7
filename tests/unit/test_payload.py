"""Bucket wire format, the receiver-side loader (on the builtin tiny model) and the delta snapshot."""

from __future__ import annotations

import pytest
import torch

from raygym.builtin import build_tiny_model
from raygym.errors import WeightSyncError
from raygym.weightsync.codec import checksum, int_view
from raygym.weightsync.loader import load_payload, model_checksums
from raygym.weightsync.payload import (
    ALIGN,
    BUCKET_NAME,
    MANIFEST_NAME,
    BucketBuffer,
    Manifest,
    encode_tensor,
    pack_bucket,
    unpack_bucket,
)
from raygym.weightsync.snapshot import WeightSnapshot


def perturbed(model: torch.nn.Module, frac: float, seed: int) -> dict[str, torch.Tensor]:
    """HF-named copies of the model's tensors with about ``frac`` of the elements changed."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        t = p.detach().clone()
        mask = torch.rand(t.shape, generator=gen) < frac
        t[mask] += 0.01 * (1 + torch.rand(int(mask.sum()), generator=gen))
        out[name] = t
    return out


def test_pack_unpack_round_trip_and_alignment():
    tensors = {
        "a": torch.arange(5, dtype=torch.float32),
        "b": torch.ones(3, 3, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
    }
    manifest, flat = pack_bucket([encode_tensor(n, t) for n, t in tensors.items()], version=7)
    m, parts = unpack_bucket(manifest, flat)
    assert m.version == 7 and m.total_bytes == flat.numel()
    for entry, payload in parts:
        assert entry.offset % ALIGN == 0
        t = tensors[entry.name]
        assert entry.shape == list(t.shape) and entry.encoding == "full"
        assert torch.equal(payload.view(t.dtype).reshape(t.shape), t)
        assert entry.checksum == checksum(t)


def test_delta_entry_when_smaller_else_full():
    old = torch.zeros(1000, dtype=torch.float32)
    sparse = old.clone()
    sparse[10] = 1.0
    dense = torch.randn(1000)
    assert encode_tensor("w", sparse, old, "indices").encoding == "indices"
    assert encode_tensor("w", dense, old, "indices").encoding == "full"  # delta would be larger
    enc = encode_tensor("w", sparse, old, "deltas")
    assert enc.changed == 1 and enc.checksum == checksum(sparse)


def test_manifest_and_buffer_must_agree():
    manifest, flat = pack_bucket([encode_tensor("w", torch.ones(4))], version=1)
    with pytest.raises(ValueError, match="bucket buffer has"):
        unpack_bucket(manifest, flat[:-1])
    with pytest.raises(ValueError, match="not a raygym bucket manifest"):
        Manifest.from_bytes(b'{"format": "other"}')


def test_loader_applies_full_then_deltas_and_verifies():
    engine, _ = build_tiny_model(seed=0)
    trainer, _ = build_tiny_model(seed=1)  # different weights: a full sync must overwrite all of them
    full = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    manifest, flat = pack_bucket([encode_tensor(n, t) for n, t in full.items()], version=1)
    report = load_payload(engine, [(MANIFEST_NAME, manifest), (BUCKET_NAME, flat)])
    assert report.versions == {1} and report.tensors == len(full)
    assert model_checksums(engine) == {n: checksum(t) for n, t in full.items()}

    snapshot = full
    for version, encoding in [(2, "indices"), (3, "deltas"), (4, "deltas_zstd")]:
        new = perturbed(trainer, 0.01, seed=version)
        trainer.load_state_dict(new)
        encoded = [encode_tensor(n, t, snapshot[n], encoding) for n, t in new.items()]
        assert {e.encoding for e in encoded} == {encoding}
        # two buckets with keyed names, as the disk transport stores them
        half = len(encoded) // 2
        pairs = []
        for key, part in (("00000", encoded[:half]), ("00001", encoded[half:])):
            m, f = pack_bucket(part, version)
            pairs += [(f"{MANIFEST_NAME}.{key}", m), (f"{BUCKET_NAME}.{key}", f)]
        load_payload(engine, pairs)
        for name, t in engine.state_dict().items():
            assert torch.equal(int_view(t), int_view(new[name])), name
        snapshot = new


def test_loader_raises_on_corruption_and_unknown_names():
    engine, _ = build_tiny_model(seed=0)
    weights = {n: t.detach().clone() + 1 for n, t in engine.state_dict().items()}
    manifest, flat = pack_bucket([encode_tensor(n, t) for n, t in weights.items()], version=5)
    flat[100] ^= 0x10  # one flipped bit in the first tensor's bytes
    with pytest.raises(WeightSyncError, match="checksum mismatch after applying version 5"):
        load_payload(engine, [(MANIFEST_NAME, manifest), (BUCKET_NAME, flat)])
    m2, f2 = pack_bucket([encode_tensor("model.no_such.weight", torch.ones(2))], version=5)
    with pytest.raises(WeightSyncError, match="no parameter of that HF name"):
        load_payload(engine, [(MANIFEST_NAME, m2), (BUCKET_NAME, f2)])
    m3, f3 = pack_bucket([encode_tensor("lm_head.weight", weights["lm_head.weight"].half())], version=5)
    with pytest.raises(WeightSyncError, match="engine's dtype"):
        load_payload(engine, [(MANIFEST_NAME, m3), (BUCKET_NAME, f3)])
    with pytest.raises(WeightSyncError, match="incomplete raygym bucket"):
        load_payload(engine, [(MANIFEST_NAME, manifest)])


def test_loader_copies_plain_hf_named_tensors():
    engine, _ = build_tiny_model(seed=0)
    new = torch.full_like(engine.lm_head.weight, 0.5)
    load_payload(engine, [("lm_head.weight", new)])
    assert torch.equal(engine.lm_head.weight.detach(), new)


def test_snapshot_advances_only_on_commit():
    snap = WeightSnapshot()
    a0 = torch.zeros(100, dtype=torch.bfloat16)
    snap.stage("a", a0)
    assert snap.get("a") is None and snap.version is None
    snap.commit(1)
    a1 = a0.clone()
    a1[7] = 3.0
    snap.stage("a", a1)
    snap.discard()
    snap.commit(2)
    assert torch.equal(snap.get("a"), a0) and snap.version == 2
    snap.stage("a", a1)
    snap.stage("a", a1)  # re-staging the same change is harmless
    snap.commit(3)
    assert torch.equal(snap.get("a"), a1)
    snap.stage("a", torch.randn(100).to(torch.bfloat16) + 5)  # dense change: kept as a full copy
    snap.commit(4)
    assert snap.get("a").sum() != a1.sum()


def test_bucket_buffer_packs_in_place_reuses_memory_and_grows_for_one_big_entry():
    buf = BucketBuffer(max_bytes=256)
    tensors = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        assert buf.fits(n)
        buf.reserve(n).view(t.dtype).copy_(t)
        buf.add(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), "full", n, checksum(t))
    assert not buf.fits(200)  # 64 + 64 bytes used: a 200-byte entry must start a new bucket
    manifest, flat = buf.finish(version=2)
    m, parts = unpack_bucket(manifest, flat)
    for entry, payload in parts:
        assert entry.offset % ALIGN == 0 and checksum(payload) == entry.checksum
        assert torch.equal(payload.view(tensors[entry.name].dtype), tensors[entry.name])
    first = flat.data_ptr()
    buf.reset()
    buf.reserve(16).zero_()
    buf.add("c", (16,), "uint8", "full", 16, checksum(torch.zeros(16, dtype=torch.uint8)))
    assert buf.finish(3)[1].data_ptr() == first  # the same memory serves the next bucket
    buf.reset()
    assert buf.fits(1000)  # an empty bucket takes any entry; the buffer grows for it
    big = buf.reserve(1000)
    assert big.numel() == 1000


def test_dense_overwrite_then_discard_invalidates_the_snapshot():
    snap = WeightSnapshot()
    a0 = torch.zeros(64, dtype=torch.bfloat16)
    snap.stage("a", a0)
    snap.commit(1)
    held = snap.get("a")
    snap.overwrite("a", torch.ones(64, dtype=torch.bfloat16))  # a full payload: copied in place at once
    assert snap.get("a") is held and snap.version == 1
    snap.discard()  # the engines may not hold these bytes: no delta may be encoded against them
    assert snap.version is None
    snap.overwrite("a", torch.full((64,), 2.0, dtype=torch.bfloat16))
    snap.commit(2)
    assert snap.version == 2 and snap.get("a") is held and bool((held == 2).all())


def test_receive_scratch_buffers_are_reused_up_to_their_cap():
    from raygym.weightsync.transport_dist import ScratchBuffers

    scratch = ScratchBuffers(max_bytes=256)
    first = scratch.get(0, torch.float32, [16])
    again = scratch.get(0, torch.bfloat16, [4, 4])  # a smaller request reuses the same memory
    assert again.data_ptr() == first.data_ptr() and again.shape == (4, 4) and again.dtype == torch.bfloat16
    big = scratch.get(1, torch.uint8, [250])  # 64 + 250 bytes would pass the cap: not kept
    assert scratch.get(1, torch.uint8, [250]).data_ptr() != big.data_ptr()
