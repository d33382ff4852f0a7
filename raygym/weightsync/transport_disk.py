"""The ``disk`` transport: safetensors shards under ``update_weight_disk_dir/v{version:06d}/`` on any
fsspec URL (local path, ``file://``, ``s3://``, ``memory://``...).

Layout of one version directory::

    shard-00000.safetensors   a bucket (see below)
    ...
    manifest.json             version, shards, and per tensor: name, shape, dtype, encoding, checksum
    DONE                      written last: the directory is complete

A shard holds, by ``route``:

- ``raygym_bucket`` (raygym's server): tensors "__raygym_manifest__.00000" and "__raygym_bucket__.00000"
  (uint8); engines load the directory through ``/update_weights_from_disk`` {model_path, load_format:
  raygym's loader}, full or delta;
- ``hf_dir`` (stock SGLang, full): the bucket's HF-named tensors in their own dtypes, so the directory is a
  Hugging Face checkpoint that SGLang's ``/update_weights_from_disk`` {model_path} loads with its own loader;
- ``tensor_pointer`` (stock SGLang, delta): raygym buckets as in the first case; each engine receives, through
  ``/update_weights_from_tensor``, only a pointer to the directory with ``load_format`` =
  ``raygym.weightsync.loader.load_payload_via_model`` (SGLang's custom-weight-loader hook). That loader
  rebuilds full tensors from a host snapshot and writes one ``ack-e{engine}-r{tp_rank}.json`` per TP rank
  with the checksums it produced (it must never raise inside SGLang's scheduler); the sender checks them.

Every file is written under a temporary name and renamed. The directory is removed once every engine
acknowledged. ``memory://`` lives inside one process, so it only works when the engine runs in the sender's
process; separate servers need a filesystem they share.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from raygym.engine_api.protocol import Endpoint, UpdateWeightsFromDisk, UpdateWeightsFromTensor
from raygym.errors import WeightSyncError
from raygym.weightsync.codec import as_uint8, dtype_from_name
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, FORMAT, LOADER, MANIFEST_NAME, Manifest
from raygym.weightsync.tensor_pickle import POINTER_NAME, dumps_named_tensors

MANIFEST_FILE = "manifest.json"
DONE_FILE = "DONE"
ROUTES = ("raygym_bucket", "hf_dir", "tensor_pointer")
MODEL_LOADER = "raygym.weightsync.loader.load_payload_via_model"
# safetensors' dtype codes
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
              torch.bool: "BOOL"}
_ST_TORCH = {code: dtype for dtype, code in _ST_DTYPES.items()}


def ack_file(engine: int, tp_rank: int) -> str:
    """Name of the acknowledgement an engine's TP rank writes after loading a pointed-to version."""
    return f"ack-e{engine}-r{tp_rank}.json"


def version_dir(disk_dir: str, version: int) -> str:
    """``disk_dir`` joined with ``v{version:06d}``."""
    return f"{disk_dir.rstrip('/')}/v{version:06d}"


def _atomic_write(fs: Any, path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)


def write_shard(fs: Any, path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write CPU tensors as one safetensors file straight from their memory (temp name, then rename);
    returns its size. The header is padded so the first tensor starts 64-byte aligned."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 64)  # the format allows trailing spaces in the header
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy: Buffer on 3.12+ only
    fs.mv(tmp, path)
    return 8 + len(raw) + offset


def read_shard(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, as views into ``data`` (no copy)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    body = as_uint8(memoryview(data)[8 + size :])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_TORCH:
            raise WeightSyncError(f"shard tensor {name!r} has dtype {info['dtype']}, not one raygym reads")
        start, end = info["data_offsets"]
        dtype = _ST_TORCH[info["dtype"]]
        raw = body[start:end]
        out[name] = (raw if dtype == torch.uint8 else raw.view(dtype)).view(tuple(info["shape"]))
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
                 keep: bool = False, route: str = "raygym_bucket", tp_sizes: list[int] | None = None):
        if not disk_dir:
            from raygym.errors import ConfigError

            raise ConfigError(
                "update_weight_disk_dir='': the disk transport needs a directory every engine can read; "
                "set --update-weight-disk-dir /shared/raygym-sync (any fsspec URL)"
            )
        import fsspec

        if route not in ROUTES:
            raise ValueError(f"route={route!r}: one of {ROUTES}")
        self.route = route
        self.engines = list(engines)
        self.tp_sizes = list(tp_sizes) if tp_sizes else [1] * len(self.engines)
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

    def close_group(self) -> None:
        """No connection state to drop."""

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

    def announce(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Nothing to start early: each bucket is handed over whole in :meth:`send_bucket`."""

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Write one shard (bucket buffer first, so its entries stay aligned in the file)."""
        key = f"{len(self._shards):05d}"
        file = f"shard-{key}.safetensors"
        entries = Manifest.from_bytes(manifest).entries
        if self.route == "hf_dir":  # the bucket's tensors under their HF names: a HF checkpoint shard
            flat = flat.cpu()
            tensors = {e.name: flat[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(tuple(e.shape))
                       for e in entries}
        else:
            tensors = {f"{BUCKET_NAME}.{key}": flat.cpu(), f"{MANIFEST_NAME}.{key}": manifest.cpu()}
        size = write_shard(self.fs, f"{self._path}/{file}", tensors)
        self._shards.append({"file": file, "key": key, "bytes": size})
        for e in entries:
            self._tensors.append({"name": e.name, "shape": e.shape, "dtype": e.dtype, "encoding": e.encoding,
                                  "checksum": e.checksum, "shard": file})

    def finish(self, version: int) -> None:
        """Write the manifest and DONE, have every engine load the directory, then remove it."""
        doc = {"format": FORMAT, "version": version, "route": self.route, "shards": self._shards,
               "tensors": self._tensors}
        _atomic_write(self.fs, f"{self._path}/{MANIFEST_FILE}", json.dumps(doc).encode())
        _atomic_write(self.fs, f"{self._path}/{DONE_FILE}", b"")
        futures = [self._pool.submit(checked, link, *self._load_request(i, version), self.timeout_s)
                   for i, link in enumerate(self.engines)]
        failed = []
        for link, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=self.timeout_s)
            except Exception as exc:
                failed.append(f"{link.name} ({exc})")
        if not failed and self.route == "tensor_pointer":
            failed = self._check_acks()
        if failed:
            raise WeightSyncError(f"version {version} from {self.url}: engine(s) failed to load: {'; '.join(failed)}")
        if not self.keep:
            self.fs.rm(self._path, recursive=True)

    def _load_request(self, engine: int, version: int
                      ) -> tuple[Endpoint, UpdateWeightsFromDisk | UpdateWeightsFromTensor]:
        """(endpoint, request) that makes engine ``engine`` load this version directory."""
        if self.route == "raygym_bucket":
            return Endpoint.UPDATE_WEIGHTS_FROM_DISK, UpdateWeightsFromDisk(model_path=self.url, load_format=LOADER,
                                                                            weight_version=str(version))
        if self.route == "hf_dir":
            return Endpoint.UPDATE_WEIGHTS_FROM_DISK, UpdateWeightsFromDisk(model_path=self.url,
                                                                            weight_version=str(version))
        pointer = json.dumps({"url": self.url, "engine": engine, "version": version}).encode()
        named = [(POINTER_NAME, torch.frombuffer(bytearray(pointer), dtype=torch.uint8))]
        return Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, UpdateWeightsFromTensor(
            serialized_named_tensors=[dumps_named_tensors(named)] * self.tp_sizes[engine],
            load_format=MODEL_LOADER, flush_cache=False, weight_version=str(version))

    def _check_acks(self) -> list[str]:
        """Every TP rank of every engine acknowledged, with the checksums of this version's manifest."""
        expected = {t["name"]: t["checksum"] for t in self._tensors}
        failed = []
        for engine, (link, tp) in enumerate(zip(self.engines, self.tp_sizes, strict=True)):
            for rank in range(tp):
                path = f"{self._path}/{ack_file(engine, rank)}"
                if not self.fs.exists(path):
                    failed.append(f"{link.name} TP rank {rank}: no acknowledgement (is raygym importable by the "
                                  "engine's Python, and its custom weight loader registered?)")
                    continue
                ack = json.loads(self.fs.cat_file(path))
                if not ack.get("ok"):
                    failed.append(f"{link.name} TP rank {rank}: {ack.get('error', 'failed')}")
                    continue
                wrong = [n for n, h in expected.items() if ack.get("checksums", {}).get(n) != h]
                if wrong:
                    failed.append(f"{link.name} TP rank {rank}: {len(wrong)} tensor(s) differ after loading {wrong[:3]}")
        return failed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
