"""Runs in trainer rank 0: turns the trainer's HF-named tensors into buckets and hands them to a transport.

``TrainerActor`` needs only thin methods around :class:`RankWeightSync` (every rank iterates
``iter_hf_weights()``; only rank 0 owns a sender)::

    def init_weight_sync(self, spec: SenderSpec) -> dict:
        self._wsync = RankWeightSync(self.rank)
        return self._wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False) -> dict:
        return self._wsync.push(version, self.backend.iter_hf_weights(), force_full)

    def commit_weights(self, version: int) -> None:
        self._wsync.commit(version)

    def discard_weights(self) -> None:
        self._wsync.discard()

    def reconnect_weight_sync(self) -> dict:
        return self._wsync.reconnect()

    def close_weight_sync(self) -> None:
        self._wsync.close()

The sender keeps the single CPU snapshot for delta payloads; the coordinator calls ``commit(version)``
once every engine verified ``version`` (or ``discard()`` when a sync failed).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from raygym.errors import ConfigError, WeightSyncError
from raygym.weightsync.buckets import BucketPlanner, TensorMeta
from raygym.weightsync.codec import ENCODINGS, dtype_from_name
from raygym.weightsync.engine_link import EngineLink, as_link
from raygym.weightsync.payload import FULL, EncodedTensor, encode_tensor, pack_bucket, packed_size
from raygym.weightsync.snapshot import WeightSnapshot

MODES = ("full", "delta")
TRANSPORTS = ("nccl", "disk", "ipc")


@dataclass
class SenderSpec:
    """Everything rank 0 needs to push weights; picklable, so it can travel to the trainer actor.

    Field names follow the recipe: ``transport`` = update_weight_transport, ``mode`` = update_weight_mode,
    ``encoding`` = update_weight_encoding, ``buffer_size`` = update_weight_buffer_size, ``disk_dir`` =
    update_weight_disk_dir, ``timeout_s`` = update_weight_timeout.
    """

    engines: list[Any]  # EngineLink objects or base URLs
    transport: str = "nccl"
    mode: str = "full"
    encoding: str = "indices"
    buffer_size: int = 512 * 1024 * 1024
    timeout_s: float = 600.0
    disk_dir: str = ""
    colocate: bool = False
    tp_sizes: list[int] | None = None
    master_address: str | None = None  # default: this node's IP under Ray, else 127.0.0.1
    backend: str | None = None  # default: nccl with CUDA, else gloo
    cast_dtype: str | None = None  # engine dtype (e.g. "bfloat16"): floating tensors are cast before encoding
    keep_disk_versions: bool = False
    group_protocol: str = "sglang"  # "raygym" for raygym's built-in server (see transport_dist.join_group)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"update_weight_transport={self.transport!r}: use one of {TRANSPORTS}")
        if self.mode not in MODES:
            raise ConfigError(f"update_weight_mode={self.mode!r}: use 'full' or 'delta'")
        if self.encoding not in ENCODINGS:
            raise ConfigError(f"update_weight_encoding={self.encoding!r}: use one of {ENCODINGS}")
        if self.timeout_s <= 0:
            raise ConfigError(f"update_weight_timeout={self.timeout_s!r}: must be > 0 seconds, e.g. 600")
        if self.transport == "disk" and not self.disk_dir:
            raise ConfigError("update_weight_disk_dir='': required by update_weight_transport='disk'; "
                              "set --update-weight-disk-dir to a directory every engine can read")

    @classmethod
    def from_recipe(cls, recipe: Any, engines: list[Any], **overrides: Any) -> SenderSpec:
        """Read the update_weight_* fields of a ``Recipe`` (missing fields keep the defaults above)."""
        fields = {"transport": "update_weight_transport", "mode": "update_weight_mode",
                  "encoding": "update_weight_encoding", "buffer_size": "update_weight_buffer_size",
                  "timeout_s": "update_weight_timeout", "disk_dir": "update_weight_disk_dir",
                  "colocate": "colocate"}
        kwargs = {k: getattr(recipe, f) for k, f in fields.items() if getattr(recipe, f, None) is not None}
        kwargs.update(overrides)
        return cls(engines=engines, **kwargs)


def drain(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Consume the weight iterator on ranks other than 0 (they take part in gathering full tensors)."""
    for _ in weights:
        pass
    return {}


class WeightSender:
    """Encodes (full or delta), buckets and transfers weights; keeps the delta snapshot."""

    def __init__(self, spec: SenderSpec):
        self.spec = spec
        self.links: list[EngineLink] = [as_link(e, i) for i, e in enumerate(spec.engines)]
        self.snapshot = WeightSnapshot()
        self.transport = self._make_transport()
        self._cast = dtype_from_name(spec.cast_dtype) if spec.cast_dtype else None
        self._pending_version: int | None = None

    def setup(self) -> dict[str, Any]:
        """Connect the transport (the dist group is formed here); returns a description."""
        start = time.perf_counter()
        self.transport.connect()
        return {"transport": self.transport.kind, "connect_s": time.perf_counter() - start,
                "engines": [link.name for link in self.links]}

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
             force_full: bool = False) -> dict[str, Any]:
        """Send ``version`` to every engine; returns ``{"mode", "metrics", "checksums"}``.

        Delta mode sends deltas against the snapshot, except on the first push or when ``force_full``.
        Changes are staged, not committed: call :meth:`commit` after the engines verified.
        """
        delta = self.spec.mode == "delta" and not force_full and self.snapshot.version is not None
        self.snapshot.discard()
        if not getattr(self.transport, "connected", True):
            self.transport.connect()
        self.transport.begin(version)
        planner = BucketPlanner(self.spec.buffer_size)
        stats = {"bytes": 0, "raw_bytes": 0, "changed": 0, "numel": 0, "encode_s": 0.0, "transfer_s": 0.0}
        checksums: dict[str, str] = {}
        bucket: list[EncodedTensor] = []
        inflight: Future | None = None
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raygym-send")
        start = time.perf_counter()

        def send(items: list[EncodedTensor]) -> float:
            t0 = time.perf_counter()
            manifest, flat = pack_bucket(items, version)
            self.transport.send_bucket(version, manifest, flat)
            stats["bytes"] += int(manifest.numel() + flat.numel())
            return time.perf_counter() - t0

        def flush(items: list[EncodedTensor]) -> None:
            nonlocal inflight
            if inflight is not None:  # one bucket in flight while the next one is encoded
                stats["transfer_s"] += inflight.result()
            inflight = pool.submit(send, items)

        try:
            for name, tensor in named_tensors:
                t0 = time.perf_counter()
                tensor = self._prepare(tensor)
                old = self.snapshot.get(name) if delta else None
                enc = encode_tensor(name, tensor, old, self.spec.encoding if delta else FULL)
                if self.spec.mode == "delta":
                    self.snapshot.stage(name, tensor, enc.data if enc.encoding != FULL else None)
                stats["encode_s"] += time.perf_counter() - t0
                checksums[name] = enc.checksum
                stats["changed"] += enc.changed if old is not None else enc.numel
                stats["numel"] += enc.numel
                stats["raw_bytes"] += enc.numel * tensor.element_size()
                full = planner.add(TensorMeta(name, enc.shape, enc.dtype, packed_size(enc.nbytes)))
                if full is not None:
                    flush(bucket[: len(full.metas)])
                    bucket = bucket[len(full.metas) :]
                bucket.append(enc)
            if bucket:
                flush(bucket)
            if inflight is not None:
                stats["transfer_s"] += inflight.result()
            t0 = time.perf_counter()
            self.transport.finish(version)
            stats["transfer_s"] += time.perf_counter() - t0
        except Exception:
            self.snapshot.discard()
            raise
        finally:
            pool.shutdown(wait=True)
        self._pending_version = version
        total_s = time.perf_counter() - start
        return {"mode": "delta" if delta else "full", "checksums": checksums,
                "metrics": self._metrics(stats, total_s, delta)}

    def commit(self, version: int) -> None:
        """Every engine verified ``version``: advance the snapshot (delta mode only)."""
        if self._pending_version != version:
            raise WeightSyncError(f"commit({version}) but the last push was version {self._pending_version}")
        if self.spec.mode == "delta":
            self.snapshot.commit(version)
        self._pending_version = None

    def discard(self) -> None:
        """The last push failed verification: forget its staged changes (a full resync follows)."""
        self.snapshot.discard()
        self._pending_version = None

    def reconnect(self) -> dict[str, Any]:
        """Form the group again (e.g. after an engine restarted); the next push should be full."""
        if hasattr(self.transport, "close_group"):
            self.transport.close_group()
        return self.setup()

    def close(self) -> None:
        self.transport.close()

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self._cast is not None and tensor.is_floating_point() and tensor.dtype != self._cast:
            tensor = tensor.to(self._cast)
        return tensor

    def _make_transport(self):
        spec = self.spec
        address = spec.master_address or _node_ip()
        if spec.transport == "disk":
            from raygym.weightsync.transport_disk import DiskTransport

            return DiskTransport(self.links, disk_dir=spec.disk_dir, timeout_s=spec.timeout_s,
                                 keep=spec.keep_disk_versions)
        if spec.transport == "ipc" or (spec.colocate and spec.mode == "full"):
            from raygym.weightsync.transport_ipc import make_colocated_transport

            return make_colocated_transport(self.links, tp_sizes=spec.tp_sizes, master_address=address,
                                            timeout_s=spec.timeout_s, protocol=spec.group_protocol)
        from raygym.weightsync.transport_dist import DistTransport

        return DistTransport(self.links, master_address=address, tp_sizes=spec.tp_sizes, backend=spec.backend,
                             timeout_s=spec.timeout_s, protocol=spec.group_protocol)

    @staticmethod
    def _metrics(stats: dict[str, float], total_s: float, delta: bool) -> dict[str, float]:
        moved = stats["bytes"]
        return {
            "sync/bytes": float(moved),
            "sync/raw_bytes": float(stats["raw_bytes"]),
            "sync/changed_frac": stats["changed"] / max(1, stats["numel"]),
            "sync/encode_s": stats["encode_s"],
            "sync/transfer_s": stats["transfer_s"],
            "sync/total_s": total_s,
            "sync/gbps": moved / 1e9 / max(total_s, 1e-9),
            "sync/mode": 1.0 if delta else 0.0,
        }


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


class RankWeightSync:
    """The weight-sync state of one trainer rank: a :class:`WeightSender` on rank 0, nothing elsewhere."""

    def __init__(self, rank: int):
        self.rank = rank
        self.sender: WeightSender | None = None

    def init(self, spec: SenderSpec) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(spec)
        return self.sender.setup()

    def push(self, version: int, weights: Iterable[tuple[str, torch.Tensor]], force_full: bool = False
             ) -> dict[str, Any]:
        if self.sender is None:
            return drain(weights)
        return self.sender.push(version, weights, force_full=force_full)

    def commit(self, version: int) -> None:
        if self.sender is not None:
            self.sender.commit(version)

    def discard(self) -> None:
        if self.sender is not None:
            self.sender.discard()

    def reconnect(self) -> dict[str, Any]:
        return self.sender.reconnect() if self.sender is not None else {}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
