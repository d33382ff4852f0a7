"""The ``disk`` transport: safetensors shards under ``update_weight_disk_dir/v{version:06d}/`` on any
fsspec URL (local path, ``file://``, ``s3://``, ``memory://``...).

Layout of one version directory::

    shard-00000.safetensors   tensors "__raygym_manifest__.00000" and "__raygym_bucket__.00000" (uint8)
    ...
    manifest.json             version, shards, and per tensor: name, shape, dtype, encoding, checksum
    DONE                      written last: the directory is complete

Every file is written under a temporary name and renamed. Engines load a version through
``/update_weights_from_disk`` {model_path: the directory URL, load_format: raygym's loader}; the
directory is removed once every engine acknowledged. ``memory://`` lives inside one process, so it only
works when the engine runs in the sender's process; separate servers need a filesystem they share.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from raygym.errors import WeightSyncError
from raygym.weightsync.codec import as_uint8
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, FORMAT, LOADER, MANIFEST_NAME, Manifest

MANIFEST_FILE = "manifest.json"
DONE_FILE = "DONE"


def version_dir(disk_dir: str, version: int) -> str:
    """``disk_dir`` joined with ``v{version:06d}``."""
    return f"{disk_dir.rstrip('/')}/v{version:06d}"


def _atomic_write(fs: Any, path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def write_shard(fs: Any, path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write uint8 CPU tensors as one safetensors file straight from their memory (temp name, then
    rename); returns its size. The header is padded so the first tensor starts 64-byte aligned."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": "U8", "shape": [int(t.numel())], "data_offsets": [offset, offset + int(t.numel())]}
        offset += int(t.numel())
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 64)  # the format allows trailing spaces in the header
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().numpy()))
    fs.mv(tmp, path)
    return 8 + len(raw) + offset


def read_shard(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The uint8 tensors of a safetensors file's bytes, as views into ``data`` (no copy)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    body = as_uint8(memoryview(data)[8 + size :])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "U8":
            raise WeightSyncError(f"shard tensor {name!r} has dtype {info['dtype']}, expected U8")
        start, end = info["data_offsets"]
        out[name] = body[start:end]
    return out


def read_version_dir(url: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the (name, uint8 tensor) pairs of a complete version directory, shard by shard.

    Raises ``WeightSyncError`` if the DONE marker or a listed shard is missing.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(f"{root}/{DONE_FILE}"):
        raise WeightSyncError(f"{url}: no {DONE_FILE} marker; the version directory is incomplete")
    doc = json.loads(fs.cat_file(f"{root}/{MANIFEST_FILE}"))
    if doc.get("format") != FORMAT:
        raise WeightSyncError(f"{url}: {MANIFEST_FILE} is not a raygym manifest")
    for shard in doc["shards"]:
        path = f"{root}/{shard['file']}"
        if not fs.exists(path):
            raise WeightSyncError(f"{url}: shard {shard['file']} listed in {MANIFEST_FILE} is missing")
        try:
            tensors = read_shard(fs.cat_file(path))
        except (ValueError, KeyError) as exc:
            raise WeightSyncError(f"{url}: shard {shard['file']} is not a readable safetensors file: {exc}") from exc
        key = shard["key"]
        for name in (f"{MANIFEST_NAME}.{key}", f"{BUCKET_NAME}.{key}"):
            if name not in tensors:
                raise WeightSyncError(f"{url}: shard {shard['file']} lacks tensor {name}")
            yield name, tensors[name]


class DiskTransport:
    """Sender side of the ``disk`` transport (writes shards, then asks every engine to load them)."""

    kind = "disk"

    def __init__(self, engines: list[EngineLink], *, disk_dir: str, timeout_s: float = 600.0,
                 keep: bool = False):
        if not disk_dir:
            from raygym.errors import ConfigError

            raise ConfigError(
                "update_weight_disk_dir='': the disk transport needs a directory every engine can read; "
                "set --update-weight-disk-dir /shared/raygym-sync (any fsspec URL)"
            )
        import fsspec

        self.engines = list(engines)
        self.disk_dir = disk_dir
        self.timeout_s = float(timeout_s)
        self.keep = keep  # keep version directories (debugging)
        self.fs, self._root = fsspec.core.url_to_fs(disk_dir)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="raygym-disk")
        self._shards: list[dict[str, Any]] = []
        self._tensors: list[dict[str, Any]] = []
        self.url = ""
        self._path = ""

    @property
    def connected(self) -> bool:
        return True

    def connect(self) -> None:
        self.fs.makedirs(self._root, exist_ok=True)

    def begin(self, version: int) -> None:
        """Start a fresh version directory (a stale one from a failed attempt is removed)."""
        self.url = version_dir(self.disk_dir, version)
        self._path = version_dir(self._root, version)
        if self.fs.exists(self._path):
            self.fs.rm(self._path, recursive=True)
        self.fs.makedirs(self._path, exist_ok=True)
        self._shards, self._tensors = [], []

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Write one shard (bucket buffer first, so its entries stay aligned in the file)."""
        key = f"{len(self._shards):05d}"
        file = f"shard-{key}.safetensors"
        size = write_shard(self.fs, f"{self._path}/{file}",
                           {f"{BUCKET_NAME}.{key}": flat.cpu(), f"{MANIFEST_NAME}.{key}": manifest.cpu()})
        self._shards.append({"file": file, "key": key, "bytes": size})
        for e in Manifest.from_bytes(manifest).entries:
            self._tensors.append({"name": e.name, "shape": e.shape, "dtype": e.dtype, "encoding": e.encoding,
                                  "checksum": e.checksum, "shard": file})

    def finish(self, version: int) -> None:
        """Write the manifest and DONE, have every engine load the directory, then remove it."""
        doc = {"format": FORMAT, "version": version, "shards": self._shards, "tensors": self._tensors}
        _atomic_write(self.fs, f"{self._path}/{MANIFEST_FILE}", json.dumps(doc).encode())
        _atomic_write(self.fs, f"{self._path}/{DONE_FILE}", b"")
        payload = {"model_path": self.url, "load_format": LOADER, "weight_version": str(version)}
        futures = [self._pool.submit(checked, link, "update_weights_from_disk", payload, self.timeout_s)
                   for link in self.engines]
        failed = []
        for link, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=self.timeout_s)
            except Exception as exc:
                failed.append(f"{link.name} ({exc})")
        if failed:
            raise WeightSyncError(f"version {version} from {self.url}: engine(s) failed to load: {'; '.join(failed)}")
        if not self.keep:
            self.fs.rm(self._path, recursive=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
