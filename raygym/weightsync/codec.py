"""Byte-exact delta encoding of tensors, and tensor checksums (pure: torch + numpy, no Ray).

A delta payload lists the elements of ``new`` whose bytes differ from ``snapshot`` and their new raw
values. Elements are compared through integer views of the same width, never as floats, so NaN
payloads, -0.0 vs 0.0 and subnormals are all exact. Applying a delta overwrites those elements
(it does not xor), so applying the same payload twice is harmless.

>>> import torch
>>> old = torch.zeros(6, dtype=torch.bfloat16)
>>> new = old.clone(); new[2] = 1.5
>>> payload = encode_delta(new, old, encoding="indices")
>>> apply_delta(payload, old); bool(torch.equal(old, new))
True
>>> checksum(old) == checksum(new)
True

Wire format of a payload (little-endian, every section starts on an 8-byte boundary):
``header`` (32 bytes: magic, encoding, dtype, position width, numel, count, large-gap count), then

- ``indices``: positions (int32, or int64 when numel >= 2**31) + values;
- ``deltas``: uint16 gaps (gap = position - previous position, first previous = -1; a gap >= 65535 is
  written as the escape word 65535 and its exact value goes to a uint64 side list) + that side list +
  values;
- ``deltas_zstd``: the ``deltas`` body compressed with zstd level 1.
"""

from __future__ import annotations

import struct
import warnings

import numpy as np
import torch
import xxhash

ENCODINGS = ("indices", "deltas", "deltas_zstd")
_ENCODING_IDS = {name: i for i, name in enumerate(ENCODINGS)}

# Every dtype a model may carry; the id is what goes on the wire.
_DTYPES: tuple[torch.dtype, ...] = (
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
)
_DTYPE_IDS = {dt: i for i, dt in enumerate(_DTYPES)}
# Integer view of the same width used for byte comparison and scatter.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

_MAGIC = b"RGD1"
_HEADER = struct.Struct("<4sBBBxQQQ")  # magic, encoding, dtype, pos width, pad, numel, count, n_large
assert _HEADER.size == 32
_ESCAPE = 0xFFFF
_ZSTD_LEVEL = 1

Buffer = bytes | bytearray | memoryview | torch.Tensor


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling SGLang's HTTP API uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` for an unknown or unsupported name."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_IDS:
        raise ValueError(f"unsupported dtype {name!r}; supported: {[dtype_name(d) for d in _DTYPES]}")
    return dtype


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``tensor``'s bytes (same storage, same element width; bool as uint8)."""
    if tensor.dtype not in _DTYPE_IDS:
        raise ValueError(f"unsupported dtype {tensor.dtype}; supported: {list(_DTYPES)}")
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_VIEW[flat.element_size()])


def as_uint8(buf: Buffer) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``buf`` without copying (read-only buffers are only ever read)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8:
            raise ValueError(f"payload tensor must be uint8, got {buf.dtype}")
        return buf.reshape(-1)
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # bytes are read-only; we never write through this view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` as a flat contiguous uint8 CPU tensor (no copy when already so)."""
    flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).cpu()


def checksum(tensor: torch.Tensor) -> str:
    """xxh3_64 hex digest of the tensor's raw bytes (contiguous, native byte order).

    >>> checksum(torch.zeros(2, dtype=torch.float32)) == checksum(torch.zeros(8, dtype=torch.uint8))
    True
    """
    raw = tensor_bytes(tensor)
    if raw.numel() == 0:
        return xxhash.xxh3_64_hexdigest(b"")
    return xxhash.xxh3_64_hexdigest(memoryview(raw.numpy()))


def changed_positions(new: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions where ``new`` and ``snapshot`` differ in their bytes."""
    _check_pair(new, snapshot)
    a, b = int_view(new.detach()), int_view(snapshot.detach().to(new.device))
    return torch.nonzero(a != b, as_tuple=False).reshape(-1)


def encode_delta(new: torch.Tensor, snapshot: torch.Tensor, encoding: str = "indices") -> bytes:
    """Encode the elements of ``new`` whose bytes differ from ``snapshot`` (same shape and dtype).

    ``encoding`` is ``"indices"``, ``"deltas"`` or ``"deltas_zstd"``; the payload is self-describing.
    """
    if encoding not in _ENCODING_IDS:
        raise ValueError(f"unknown delta encoding {encoding!r}; use one of {ENCODINGS}")
    positions = changed_positions(new, snapshot)
    values = int_view(new.detach())[positions].cpu().numpy()
    numel = new.numel()
    pos_np = positions.cpu().numpy()
    pos_width = 4 if numel < 2**31 else 8
    if encoding == "indices":
        body = [pos_np.astype(np.int32 if pos_width == 4 else np.int64), values]
        n_large = 0
    else:
        words, large = _gaps(pos_np)
        n_large = int(large.size)
        body = [words, large, values]
    header = _HEADER.pack(
        _MAGIC, _ENCODING_IDS[encoding], _DTYPE_IDS[new.dtype], pos_width, numel, int(pos_np.size), n_large
    )
    packed = _concat_aligned(body)
    if encoding == "deltas_zstd":
        import zstandard

        packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(packed)
    return header + packed


def apply_delta(payload: Buffer, target: torch.Tensor) -> torch.Tensor:
    """Overwrite ``target`` in place with the values carried by ``payload``; returns ``target``.

    Idempotent. ``target`` must be contiguous, with the dtype and element count of the encoded tensor.
    """
    header = read_header(payload)
    enc, dtype, pos_width, numel, count, n_large = header
    if target.dtype != dtype or target.numel() != numel:
        raise ValueError(
            f"delta payload is for {numel} elements of {dtype}, target has {target.numel()} of {target.dtype}"
        )
    if not target.is_contiguous():
        raise ValueError("apply_delta needs a contiguous target tensor")
    if count == 0:
        return target
    raw = as_uint8(payload)
    body = raw[_HEADER.size :]
    if enc == "deltas_zstd":
        import zstandard

        body = as_uint8(zstandard.ZstdDecompressor().decompress(body.numpy().tobytes()))
    width = target.element_size()
    if enc == "indices":
        pos_dt = torch.int32 if pos_width == 4 else torch.int64
        positions, rest = _take(body, count, pos_dt)
        positions = positions.long()
    else:
        words, rest = _take(body, count, torch.int16)
        large, rest = _take(rest, n_large, torch.int64)
        gaps = words.view(torch.int16).to(torch.int64) & _ESCAPE  # uint16 read through int16
        if n_large:
            gaps[gaps == _ESCAPE] = large
        positions = torch.cumsum(gaps, 0) - 1
    values, _ = _take(rest, count, _INT_VIEW[width])
    view = int_view(target)
    view[positions.to(target.device)] = values.to(target.device)
    return target


def read_header(payload: Buffer) -> tuple[str, torch.dtype, int, int, int, int]:
    """(encoding, dtype, position width, numel, changed count, large-gap count) of a delta payload."""
    raw = as_uint8(payload)
    if raw.numel() < _HEADER.size:
        raise ValueError(f"delta payload too short ({raw.numel()} bytes)")
    magic, enc, dt, pos_width, numel, count, n_large = _HEADER.unpack(raw[: _HEADER.size].numpy().tobytes())
    if magic != _MAGIC:
        raise ValueError(f"not a raygym delta payload (magic {magic!r})")
    return ENCODINGS[enc], _DTYPES[dt], pos_width, numel, count, n_large


def _check_pair(new: torch.Tensor, snapshot: torch.Tensor) -> None:
    if new.dtype != snapshot.dtype or new.shape != snapshot.shape:
        raise ValueError(
            f"delta needs the same shape and dtype: new {tuple(new.shape)} {new.dtype}, "
            f"snapshot {tuple(snapshot.shape)} {snapshot.dtype}"
        )


def _gaps(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split positions into uint16 gap words and the uint64 side list of escaped (large) gaps."""
    gaps = np.diff(positions.astype(np.int64), prepend=np.int64(-1))
    big = gaps >= _ESCAPE
    words = np.where(big, _ESCAPE, gaps).astype(np.uint16)
    return words, gaps[big].astype(np.uint64)


def _concat_aligned(parts: list[np.ndarray]) -> bytes:
    chunks = []
    for part in parts:
        data = np.ascontiguousarray(part).tobytes()
        chunks.append(data + b"\0" * (-len(data) % 8))
    return b"".join(chunks)


def _take(buf: torch.Tensor, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``count`` items of ``dtype`` from the front of ``buf``; return them and the 8-aligned rest."""
    size = count * torch.empty(0, dtype=dtype).element_size()
    section = buf[:size]
    if size and section.storage_offset() % 8:  # views need aligned storage; copy the rare misaligned case
        section = section.clone()
    return section.view(dtype), buf[size + (-size % 8) :]
