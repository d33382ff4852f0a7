"""Delta codec: byte-exact round trips for every dtype and density, idempotent apply, checksums."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from raygym.weightsync.codec import (
    ENCODINGS,
    apply_delta,
    changed_positions,
    checksum,
    encode_delta,
    int_view,
    read_header,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
DENSITIES = [0.0, 1e-4, 0.01, 0.5, 1.0]
N = 8_000


def random_tensor(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random values with the awkward ones mixed in for floats: NaN, +-inf, -0.0, subnormals."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)
    t = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor(
        [math.nan, math.inf, -math.inf, -0.0, 0.0, tiny / 4, -tiny / 8], dtype=torch.float64
    )
    t[: len(specials)] = specials.to(dtype)
    return t


def mutate(old: torch.Tensor, positions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Copy of ``old`` whose bytes differ exactly at ``positions`` (xor with a random non-zero mask)."""
    new = old.clone()
    view = int_view(new)
    if old.dtype == torch.bool:
        view[positions] = 1 - view[positions]
        return new
    bits = view.element_size() * 8
    mask = torch.randint(1, 2 ** min(bits - 1, 62), (len(positions),), generator=gen, dtype=torch.int64)
    view[positions] = view[positions] ^ mask.to(view.dtype)
    return new


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a), int_view(b))


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact_at_every_density(dtype, encoding):
    gen = torch.Generator().manual_seed(hash((str(dtype), encoding)) % 2**31)
    old = random_tensor(dtype, N, gen)
    for density in DENSITIES:
        k = round(density * N)
        positions = torch.randperm(N, generator=gen)[:k].sort().values
        new = mutate(old, positions, gen)
        payload = encode_delta(new, old, encoding=encoding)
        assert read_header(payload)[4] == k
        assert torch.equal(changed_positions(new, old), positions)
        target = old.clone()
        apply_delta(payload, target)
        assert same_bytes(target, new), (dtype, encoding, density)
        apply_delta(payload, target)  # idempotent: overwrite, not xor
        assert same_bytes(target, new)
        assert checksum(target) == checksum(new)


def test_bytes_not_float_values_decide_what_changed():
    nan_a = struct.unpack("<f", struct.pack("<I", 0x7FC00001))[0]
    old = torch.tensor([0.0, nan_a, math.inf, 1e-40, 1.0], dtype=torch.float32)
    new = old.clone()
    int_view(new)[1] = 0x7FC00002  # another NaN payload: float != says "changed" for equal NaNs too
    new[0] = -0.0  # float == says "same"
    new[3] = 2e-40  # subnormal
    assert changed_positions(new, old).tolist() == [0, 1, 3]
    target = old.clone()
    apply_delta(encode_delta(new, old, "deltas"), target)
    assert same_bytes(target, new)
    assert int_view(target)[1].item() == 0x7FC00002


@pytest.mark.parametrize("encoding", ["deltas", "deltas_zstd"])
def test_gaps_longer_than_uint16_are_escaped(encoding):
    old = torch.zeros(300_000, dtype=torch.bfloat16)
    positions = torch.tensor([0, 65_534, 65_535 * 2 + 7, 299_999])
    new = old.clone()
    new[positions] = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    payload = encode_delta(new, old, encoding)
    assert read_header(payload)[5] == 2  # two gaps >= 65535
    target = old.clone()
    apply_delta(payload, target)
    assert same_bytes(target, new)


def test_sparse_payload_is_small_and_zstd_compresses():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(1_000_000, generator=gen).to(torch.bfloat16)
    new = mutate(old, torch.randperm(old.numel(), generator=gen)[:10_000].sort().values, gen)
    sizes = {enc: len(encode_delta(new, old, enc)) for enc in ENCODINGS}
    full = old.numel() * old.element_size()
    assert sizes["indices"] < 0.04 * full  # 1% changed: 6 bytes per change
    assert sizes["deltas"] < sizes["indices"]
    assert sizes["deltas_zstd"] <= sizes["deltas"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_checksum_detects_one_flipped_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    t = random_tensor(dtype, 4096, gen)
    digest = checksum(t)
    assert checksum(t.clone()) == digest
    flipped = t.clone()
    view = int_view(flipped)
    view[1234] = view[1234] ^ 1 if dtype != torch.bool else 1 - view[1234]
    assert checksum(flipped) != digest
    assert len(digest) == 16 and int(digest, 16) >= 0


def test_checksum_covers_non_contiguous_and_shape_independent_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert checksum(t.t()) == checksum(t.t().contiguous())
    assert checksum(t) == checksum(t.reshape(-1))


def test_apply_rejects_a_payload_for_another_tensor():
    old = torch.zeros(10, dtype=torch.float16)
    new = old.clone()
    new[3] = 1
    payload = encode_delta(new, old)
    with pytest.raises(ValueError, match="payload is for 10 elements"):
        apply_delta(payload, torch.zeros(10, dtype=torch.float32))
    with pytest.raises(ValueError, match="payload is for 10 elements"):
        apply_delta(payload, torch.zeros(11, dtype=torch.float16))
    with pytest.raises(ValueError, match="same shape and dtype"):
        encode_delta(new, old.float())
    with pytest.raises(ValueError, match="unknown delta encoding"):
        encode_delta(new, old, encoding="xor")
    with pytest.raises(ValueError, match="not a raygym delta payload"):
        apply_delta(b"x" * 64, old)
