"""One bucket on the wire: a JSON manifest plus one flat uint8 buffer.

The manifest lists, per tensor: HF name, shape, dtype, encoding (``full`` or a delta encoding from
:mod:`raygym.weightsync.codec`), byte offset and size inside the flat buffer, and the checksum of the
tensor the receiver must END with (not of the payload). Every entry starts on a 64-byte boundary.

Over torch.distributed a bucket is two uint8 tensors named :data:`MANIFEST_NAME` and
:data:`BUCKET_NAME` broadcast in that order, loaded with ``load_format=LOADER`` (SGLang's custom
weight-loader convention). On disk the two tensors are stored in one safetensors shard.

>>> import torch
>>> enc = encode_tensor("w", torch.arange(4, dtype=torch.float32))
>>> manifest, flat = pack_bucket([enc], version=3)
>>> m, parts = unpack_bucket(manifest, flat)
>>> m.version, [(e.name, e.encoding, tuple(p.shape)) for e, p in parts]
(3, [('w', 'full', (16,))])
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raygym.weightsync.codec import (
    Buffer,
    as_uint8,
    checksum,
    dtype_name,
    encode_delta,
    read_header,
    tensor_bytes,
)

MANIFEST_NAME = "__raygym_manifest__"
BUCKET_NAME = "__raygym_bucket__"
# SGLang imports a custom weight loader by dotted path and matches ``load_format`` against the
# registered string, so senders and every server's --custom-weight-loader use exactly this string.
LOADER = "raygym.weightsync.loader.load_payload"
FORMAT = "raygym.bucket.v1"
FULL = "full"
ALIGN = 64  # bytes; keeps every entry's integer views aligned


@dataclass
class EncodedTensor:
    """One tensor ready for a bucket: its payload bytes and the checksum of the resulting tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str
    data: torch.Tensor  # flat uint8, CPU
    checksum: str
    changed: int  # elements that differ from the snapshot (numel for a full payload without snapshot)
    numel: int

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@dataclass
class ManifestEntry:
    name: str
    shape: list[int]
    dtype: str
    encoding: str
    offset: int
    nbytes: int
    checksum: str


@dataclass
class Manifest:
    version: int
    entries: list[ManifestEntry]
    total_bytes: int

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "version": self.version, "total_bytes": self.total_bytes,
               "tensors": [vars(e) for e in self.entries]}  # not asdict: it deep-copies (~0.1 ms an entry)
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: Buffer) -> Manifest:
        data = as_uint8(raw).numpy().tobytes() if not isinstance(raw, bytes) else raw
        doc = json.loads(data.decode())
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a raygym bucket manifest (format {doc.get('format')!r}, expected {FORMAT!r})")
        return cls(int(doc["version"]), [ManifestEntry(**e) for e in doc["tensors"]], int(doc["total_bytes"]))


def encode_tensor(
    name: str, tensor: torch.Tensor, snapshot: torch.Tensor | None = None, encoding: str = FULL
) -> EncodedTensor:
    """Encode ``tensor`` in full, or as a delta against ``snapshot`` (same shape and dtype).

    A delta that would not be smaller than the full bytes is sent in full instead.
    """
    tensor = tensor.detach()
    shape, numel = tuple(tensor.shape), tensor.numel()
    digest = checksum(tensor)
    changed = numel
    if snapshot is not None and encoding != FULL:
        delta = encode_delta(tensor, snapshot, encoding)
        changed = read_header(delta)[4]
        if len(delta) < tensor.numel() * tensor.element_size():
            return EncodedTensor(name, shape, dtype_name(tensor.dtype), encoding, as_uint8(delta), digest,
                                 changed, numel)
    return EncodedTensor(name, shape, dtype_name(tensor.dtype), FULL, tensor_bytes(tensor), digest, changed, numel)


def packed_size(nbytes: int, align: int = ALIGN) -> int:
    """Bytes an entry of ``nbytes`` occupies in a flat buffer (rounded up to ``align``)."""
    return nbytes + (-nbytes % align)


def pack_bucket(encoded: Sequence[EncodedTensor], version: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay ``encoded`` out in one flat uint8 buffer; return (manifest bytes as uint8 tensor, flat buffer)."""
    entries, offset = [], 0
    for e in encoded:
        entries.append(ManifestEntry(e.name, list(e.shape), e.dtype, e.encoding, offset, e.nbytes, e.checksum))
        offset += packed_size(e.nbytes)
    flat = torch.empty(offset, dtype=torch.uint8)
    for e, entry in zip(encoded, entries, strict=True):
        flat[entry.offset : entry.offset + entry.nbytes].copy_(e.data)
        flat[entry.offset + entry.nbytes : entry.offset + packed_size(entry.nbytes)].zero_()
    manifest = Manifest(version, entries, offset).to_bytes()
    return torch.frombuffer(bytearray(manifest), dtype=torch.uint8), flat


class BucketBuffer:
    """A reusable flat uint8 buffer that a bucket's entries are written into directly (no staging copy).

    Holds at most ``max_bytes`` of entries, except a single larger entry, which gets the buffer alone.
    Memory is allocated on demand and kept for the next bucket (fresh pages cost as much as a copy).

    ``align``: entries start on multiples of it. 64 for raygym's own bucket format; 1 (``compact``) for
    SGLang's ``flattened_bucket``, whose tensors lie back to back: there an entry only joins a bucket
    whose end is a multiple of its item size, so every tensor can be viewed in place on arrival.

    >>> buf = BucketBuffer(max_bytes=1024)
    >>> t = torch.arange(4, dtype=torch.float32)
    >>> _ = buf.reserve(16).view(torch.float32).copy_(t); buf.add("w", (4,), "float32", FULL, 16, "x")
    >>> manifest, flat = buf.finish(version=1); [e.name for e in Manifest.from_bytes(manifest).entries]
    ['w']
    """

    def __init__(self, max_bytes: int, align: int = ALIGN):
        self.max_bytes = max_bytes
        self.align = align
        self._buf = torch.empty(0, dtype=torch.uint8)
        self.entries: list[ManifestEntry] = []
        self.offset = 0
        self.grow_s = 0.0  # seconds spent growing the buffer (new memory: a one-time cost)

    def fits(self, nbytes: int, itemsize: int = 1) -> bool:
        """Whether an entry of ``nbytes`` (elements of ``itemsize`` bytes) may join this bucket (always
        true for an empty bucket)."""
        if not self.entries:
            return True
        return self.offset % itemsize == 0 and self.offset + packed_size(nbytes, self.align) <= self.max_bytes

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The uint8 slot of the next entry (aligned as the buffer's ``align`` says)."""
        end = self.offset + packed_size(nbytes, self.align)
        if end > self._buf.numel():
            self._grow(end)
        return self._buf[self.offset : self.offset + nbytes]

    def add(self, name: str, shape: tuple[int, ...], dtype: str, encoding: str, nbytes: int, digest: str) -> None:
        """Record the entry just written into the reserved slot."""
        self.entries.append(ManifestEntry(name, list(shape), dtype, encoding, self.offset, nbytes, digest))
        pad_end = self.offset + packed_size(nbytes, self.align)
        if pad_end > self.offset + nbytes:
            self._buf[self.offset + nbytes : pad_end].zero_()
        self.offset = pad_end

    def finish(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(manifest bytes as a uint8 tensor, the flat buffer) — valid until :meth:`reset`."""
        manifest = Manifest(version, self.entries, self.offset).to_bytes()
        return torch.frombuffer(bytearray(manifest), dtype=torch.uint8), self._buf[: self.offset]

    def reset(self) -> None:
        """Empty the bucket; the memory is kept."""
        self.entries = []
        self.offset = 0

    def _grow(self, needed: int) -> None:
        start = time.perf_counter()
        size = max(needed, min(self.max_bytes, 2 * self._buf.numel()))
        bigger = torch.empty(size, dtype=torch.uint8)
        bigger[: self.offset].copy_(self._buf[: self.offset])
        bigger[self.offset :].zero_()  # the pages are touched now, so their cost is counted in grow_s
        self._buf = bigger
        self.grow_s += time.perf_counter() - start


def unpack_bucket(manifest: Buffer, flat: Buffer) -> tuple[Manifest, list[tuple[ManifestEntry, torch.Tensor]]]:
    """Parse a bucket: the manifest and, per entry, a uint8 view of its payload inside ``flat``."""
    m = Manifest.from_bytes(manifest)
    buf = as_uint8(flat)
    if buf.numel() != m.total_bytes:
        raise ValueError(f"bucket buffer has {buf.numel()} bytes, manifest says {m.total_bytes}")
    return m, [(e, buf[e.offset : e.offset + e.nbytes]) for e in m.entries]
