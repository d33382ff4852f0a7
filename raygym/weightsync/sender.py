"""Runs in trainer rank 0: turns the trainer's HF-named tensors into buckets and hands them to a transport.

``TrainerActor`` needs only thin methods around :class:`RankWeightSync` (every rank iterates
``iter_hf_weights()``; only rank 0 owns a sender)::

    def init_weight_sync(self, spec: SenderSpec) -> dict:
        self._wsync = RankWeightSync(self.rank)
        return self._wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False, refresh_snapshot: bool = True) -> dict:
        return self._wsync.push(version, self.backend.iter_hf_weights(), force_full, refresh_snapshot)

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

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from raygym.config import Recipe
from raygym.engine_api.kinds import capabilities, check_weight_sync, payload_modes
from raygym.errors import ConfigError, WeightSyncError
from raygym.weightsync import moe_names
from raygym.weightsync.buckets import BucketPlanner
from raygym.weightsync.codec import (
    ENCODINGS,
    as_uint8,
    changed_positions_np,
    checksum,
    copy_and_checksum,
    copy_bytes,
    delta_nbytes,
    dtype_from_name,
    dtype_name,
    encode_positions,
    gather_values,
    tensor_bytes,
)
from raygym.weightsync.engine_link import EngineLink, as_link
from raygym.weightsync.payload import ALIGN, FULL
from raygym.weightsync.pipeline import BucketPipeline, Lookahead
from raygym.weightsync.snapshot import WeightSnapshot
from raygym.weightsync.transport import Transport
from raygym.weightsync.vlm_names import names_for_engine

MODES = ("full", "delta", "auto")
TRANSPORTS = ("nccl", "disk", "ipc")
# Bucket cap on CPU gloo. The recipe's 512 MiB suits NCCL on GPUs; on CPU a bucket is packed while the one
# before it is on the wire, so the first one delays everything and two buffers stay in host memory. 64 MiB
# (four buckets for 200 MB to two receivers) came within 0.73-0.86 of one raw broadcast here, 32 MiB (six)
# within 0.70-0.75: each bucket costs a request and a manifest broadcast.
GLOO_BUCKET_BYTES = 64 * 1024 * 1024


# Delta pushes compare tensors against the snapshot in worker threads (numpy and xxh3 release the
# GIL), a few tensors ahead of the thread that writes buckets in order. Half the cores, at most 4:
# on a 2-core machine the engines' apply and verify need the other core during the push.
ANALYSIS_THREADS = min(4, max(1, (os.cpu_count() or 2) // 2))
ANALYSIS_LOOKAHEAD = 4


class _Analysis(NamedTuple):
    name: str
    tensor: torch.Tensor  # in the engine's dtype when a delta was computed, else as given
    dtype: torch.dtype  # the engine's dtype
    changed: int
    payload: bytes | None = None  # the delta payload, when it is smaller than the full bytes
    sparse: tuple[np.ndarray, np.ndarray] | None = None  # (positions, raw values) for the snapshot
    digest: str | None = None


class _Entry(NamedTuple):
    checksum: str
    changed: int  # elements that differ from the snapshot (numel for a full entry without snapshot)
    numel: int
    raw_bytes: int  # full size in the engine's dtype


@dataclass
class SenderSpec:
    """Everything rank 0 needs to push weights; picklable, so it can travel to the trainer actor.

    Field names follow the recipe: ``transport`` = update_weight_transport, ``mode`` = update_weight_mode,
    ``encoding`` = update_weight_encoding, ``buffer_size`` = update_weight_buffer_size, ``disk_dir`` =
    update_weight_disk_dir, ``timeout_s`` = update_weight_timeout. On CPU gloo a bucket holds at most
    :data:`GLOO_BUCKET_BYTES` whatever ``buffer_size`` says (512 MiB is the right size for NCCL on GPUs).
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
    engine_kind: str = "raygym"  # what receives: decides the wire format (raygym.engine_api.kinds)
    adapter_config: dict[str, Any] | None = None  # LoRA: the adapters' PEFT config (only adapters are sent)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"update_weight_transport={self.transport!r}: use one of {TRANSPORTS}")
        if self.mode not in MODES:
            raise ConfigError(f"update_weight_mode={self.mode!r}: use 'full', 'delta' or 'auto'")
        if self.encoding not in ENCODINGS:
            raise ConfigError(f"update_weight_encoding={self.encoding!r}: use one of {ENCODINGS}")
        BucketPlanner(self.buffer_size)  # raises ConfigError naming update_weight_buffer_size if invalid
        if self.timeout_s <= 0:
            raise ConfigError(f"update_weight_timeout={self.timeout_s!r}: must be > 0 seconds, e.g. 600")
        if self.transport == "disk" and not self.disk_dir:
            raise ConfigError("update_weight_disk_dir='': required by update_weight_transport='disk'; "
                              "set --update-weight-disk-dir to a directory every engine can read")
        check_weight_sync(self.engine_kind, mode=self.mode, transport=self.transport, colocate=self.colocate)

    @classmethod
    def from_recipe(cls, recipe: Recipe, engines: list[Any], **overrides: Any) -> SenderSpec:
        """The update_weight_* fields of a ``Recipe``; TP size per engine from ``rollout_num_gpus_per_engine``."""
        kwargs: dict[str, Any] = dict(
            transport=recipe.update_weight_transport, mode=recipe.update_weight_mode,
            encoding=recipe.update_weight_encoding, buffer_size=recipe.update_weight_buffer_size,
            timeout_s=recipe.update_weight_timeout, disk_dir=recipe.update_weight_disk_dir,
            colocate=recipe.colocate, tp_sizes=[recipe.rollout_num_gpus_per_engine] * len(engines),
        )
        kwargs.update(overrides)
        return cls(engines=engines, **kwargs)

    @property
    def payload_modes(self) -> tuple[str, ...]:
        """What the engines can receive over this transport (``auto`` chooses among these)."""
        if self.adapter_endpoints:
            return ("full",)
        return payload_modes(self.engine_kind, transport=self.transport, colocate=self.colocate)

    @property
    def adapter_endpoints(self) -> bool:
        """LoRA to engines that load adapters by endpoint: each version goes as a PEFT directory
        (:class:`raygym.weightsync.adapter.AdapterTransport`), whatever ``transport`` says."""
        return self.adapter_config is not None and capabilities(self.engine_kind).lora == "lora_endpoints"

    @property
    def keeps_snapshot(self) -> bool:
        """Deltas may be sent (``delta``, or ``auto`` where engines take deltas): keep the CPU snapshot."""
        return self.mode == "delta" or (self.mode == "auto" and "delta" in self.payload_modes)

    @property
    def hf_tensors(self) -> bool:
        """Buckets carry bare HF-named full tensors back to back (SGLang's flattened_bucket layout) instead
        of raygym's manifest + payload buffer: full syncs to engines that load through the model."""
        return capabilities(self.engine_kind).dist_format == "flattened_bucket" and not self.keeps_snapshot

    @property
    def disk_route(self) -> str:
        """How engines load a version directory (see :mod:`raygym.weightsync.transport_disk`)."""
        if self.engine_kind == "raygym":
            return "raygym_bucket"
        return "tensor_pointer" if self.keeps_snapshot else "hf_dir"


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
        self.transport: Transport = self._make_transport()
        self._cast = dtype_from_name(spec.cast_dtype) if spec.cast_dtype else None
        self._pending_version: int | None = None
        self._refresh = False  # the last push updated the snapshot
        self._pipeline = BucketPipeline(self.bucket_bytes(), align=1 if spec.hf_tensors else ALIGN)

    def bucket_bytes(self) -> int:
        """Bytes per bucket: ``buffer_size``, capped at :data:`GLOO_BUCKET_BYTES` on CPU gloo."""
        from raygym.weightsync.transport_dist import DistTransport

        if isinstance(self.transport, DistTransport) and self.transport.backend == "gloo":
            return min(self.spec.buffer_size, GLOO_BUCKET_BYTES)
        return self.spec.buffer_size

    def setup(self) -> dict[str, Any]:
        """Connect the transport (the dist group is formed here); returns a description."""
        start = time.perf_counter()
        self.transport.connect()
        return {"transport": self.transport.kind, "connect_s": time.perf_counter() - start,
                "engines": [link.name for link in self.links]}

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
             force_full: bool = False, refresh_snapshot: bool = True) -> dict[str, Any]:
        """Send ``version`` to every engine; returns ``{"mode", "metrics", "checksums"}``.

        Delta mode sends deltas against the snapshot, except on the first push, after a failed one,
        or when ``force_full``. Changes are staged: call :meth:`commit` after the engines verified.
        ``refresh_snapshot=False`` (a full push when no delta is expected next, ``auto``): the snapshot is
        not updated, which saves copying every weight, and it becomes unusable until a full push refreshes it.
        Entries are written straight into reusable bucket buffers, and bucket k+1 is encoded while
        bucket k is on the wire (:class:`~raygym.weightsync.pipeline.BucketPipeline`).
        """
        delta = self.spec.keeps_snapshot and not force_full and self.snapshot.version is not None
        self.snapshot.discard()
        self._refresh = self.spec.keeps_snapshot and (delta or refresh_snapshot)
        if not self._refresh:
            self.snapshot.invalidate()
        if not self.transport.connected:
            self.transport.connect()
        self.transport.begin(version)
        stats: dict[str, float] = {"changed": 0, "numel": 0, "raw_bytes": 0}
        checksums: dict[str, str] = {}
        pipe = self._pipeline
        one_time_before = self.snapshot.alloc_s + pipe.grow_s
        start = time.perf_counter()
        pipe.start(lambda manifest, flat: self.transport.send_bucket(version, manifest, flat), version,
                   announce=lambda manifest, flat: self.transport.announce(version, manifest, flat))
        analyses = Lookahead(ANALYSIS_THREADS if delta else 0, ANALYSIS_LOOKAHEAD)
        try:
            for item in analyses.map(lambda nt: self._analyze(nt[0], nt[1].detach(), delta), named_tensors):
                enc = self._write_entry(pipe, item)
                checksums[item.name] = enc.checksum
                stats["changed"] += enc.changed
                stats["numel"] += enc.numel
                stats["raw_bytes"] += enc.raw_bytes
            # encoding = the loop (analysis included) except waiting for a free bucket buffer;
            # it also counts the time the trainer's iterator takes to produce the tensors
            encode_s = time.perf_counter() - start - pipe.wait_s
            pipe.finish()
            t0 = time.perf_counter()
            self.transport.finish(version)
            finish_s = time.perf_counter() - t0
        except Exception:
            pipe.close()
            self.snapshot.discard()
            raise
        finally:
            analyses.close()
        self._pending_version = version
        stats.update(bytes=pipe.sent_bytes, transfer_s=pipe.transfer_s + finish_s, wait_s=pipe.wait_s,
                     buckets=pipe.buckets, encode_s=encode_s, **self._engine_answers())
        # the engines' one-time work runs while this rank encodes: the longer of the two is surely spent on it
        stats["setup_s"] = max(stats["setup_s"], self.snapshot.alloc_s + pipe.grow_s - one_time_before)
        total_s = time.perf_counter() - start
        return {"mode": "delta" if delta else "full", "checksums": checksums,
                "metrics": self._metrics(stats, total_s, delta)}

    def _engine_answers(self) -> dict[str, float]:
        """What the engines' answers to this push said (the dist transport reads them per bucket): the longest
        load, the fewest buckets any engine received in place or into a fresh region, and the longest one-time
        setup (fresh regions allocated, touched, checked and adopted)."""
        from raygym.weightsync.transport_dist import DistTransport

        if not isinstance(self.transport, DistTransport):
            return {"apply_s": 0.0, "in_place_buckets": 0, "adopted_buckets": 0, "setup_s": 0.0}
        t = self.transport
        return {"apply_s": max(t.apply_s, default=0.0), "in_place_buckets": min(t.in_place_buckets, default=0),
                "adopted_buckets": min(t.adopted_buckets, default=0), "setup_s": max(t.setup_s, default=0.0)}

    def _analyze(self, name: str, tensor: torch.Tensor, delta: bool) -> _Analysis:
        """Decide delta or full for one tensor and do the delta work (thread-safe: reads the snapshot)."""
        dtype = self._cast if self._cast is not None and tensor.is_floating_point() else tensor.dtype
        full_bytes = tensor.numel() * dtype.itemsize
        old = self.snapshot.get(name) if delta else None
        if old is None or old.shape != tensor.shape or old.dtype != dtype:
            return _Analysis(name, tensor, dtype, tensor.numel())
        new = tensor.to(device="cpu", dtype=dtype)  # no copy when it already is (one copy off a GPU)
        positions = changed_positions_np(new, old)
        changed = int(positions.size)
        if delta_nbytes(changed, new.numel(), dtype.itemsize, self.spec.encoding) < full_bytes:
            values = gather_values(new, positions)
            payload = encode_positions(positions, values, new.numel(), dtype, self.spec.encoding)
            if len(payload) < full_bytes:
                return _Analysis(name, new, dtype, changed, payload, (positions, values), checksum(new))
        return _Analysis(name, new, dtype, changed)

    def _write_entry(self, pipe: BucketPipeline, item: _Analysis) -> _Entry:
        """Write one analysed tensor into the current bucket and stage it in the snapshot."""
        tensor, dtype = item.tensor, item.dtype
        shape, numel = tuple(tensor.shape), tensor.numel()
        full_bytes = numel * dtype.itemsize
        if item.payload is not None:
            assert item.sparse is not None and item.digest is not None
            size = len(item.payload)
            copy_bytes(pipe.reserve(size, covers=full_bytes), as_uint8(item.payload))
            pipe.add(item.name, shape, dtype_name(dtype), self.spec.encoding, size, item.digest)
            self.snapshot.stage(item.name, tensor, item.sparse)
            return _Entry(item.digest, item.changed, numel, full_bytes)
        flat = tensor.reshape(-1)
        as_is = tensor.dtype == dtype and flat.is_contiguous() and flat.device.type == "cpu"
        if as_is and pipe.sends_alone(full_bytes):  # a bucket by itself: sent from the tensor's memory, no packing
            data = tensor_bytes(flat)
            digest = checksum(data)
            pipe.send_alone(item.name, shape, dtype_name(dtype), digest, data)
            if self._refresh:
                self.snapshot.overwrite(item.name, tensor)
            return _Entry(digest, item.changed, numel, full_bytes)
        slot = pipe.reserve(full_bytes, itemsize=dtype.itemsize)
        typed = slot.view(torch.uint8 if dtype == torch.bool else dtype)
        if as_is:
            digest = copy_and_checksum(slot, flat)
        else:  # cast (or move) and pack in one pass, straight into the bucket
            typed.copy_(flat)
            digest = checksum(slot)
        pipe.add(item.name, shape, dtype_name(dtype), FULL, full_bytes, digest)
        if self._refresh:  # the snapshot copies the engine-dtype bytes from the bucket
            self.snapshot.overwrite(item.name, (typed.view(torch.bool) if dtype == torch.bool else typed).view(shape))
        return _Entry(digest, item.changed, numel, full_bytes)

    def commit(self, version: int) -> None:
        """Every engine verified ``version``: advance the snapshot (when deltas may be sent)."""
        if self._pending_version != version:
            raise WeightSyncError(f"commit({version}) but the last push was version {self._pending_version}")
        if self._refresh:
            self.snapshot.commit(version)
        self._pending_version = None

    def discard(self) -> None:
        """The last push failed verification: forget its staged changes (a full resync follows)."""
        self.snapshot.discard()
        self._pending_version = None

    def reconnect(self) -> dict[str, Any]:
        """Form the group again (e.g. after an engine restarted); the next push should be full."""
        self.transport.close_group()
        return self.setup()

    def close(self) -> None:
        self.transport.close()

    def _make_transport(self) -> Transport:
        spec = self.spec
        address = spec.master_address or _node_ip()
        fmt = "flattened_bucket" if spec.hf_tensors else "raygym_bucket"
        if spec.adapter_endpoints:
            from raygym.weightsync.adapter import AdapterTransport

            assert spec.adapter_config is not None
            return AdapterTransport(self.links, directory=spec.disk_dir, config=spec.adapter_config,
                                    engine_kind=spec.engine_kind, timeout_s=spec.timeout_s)
        if spec.transport == "disk":
            from raygym.weightsync.transport_disk import DiskTransport

            return DiskTransport(self.links, disk_dir=spec.disk_dir, timeout_s=spec.timeout_s,
                                 keep=spec.keep_disk_versions, route=spec.disk_route, tp_sizes=spec.tp_sizes)
        if spec.transport == "ipc" or (spec.colocate and not spec.keeps_snapshot):
            from raygym.weightsync.transport_ipc import make_colocated_transport

            return make_colocated_transport(self.links, tp_sizes=spec.tp_sizes, master_address=address,
                                            timeout_s=spec.timeout_s, fmt=fmt)
        from raygym.weightsync.transport_dist import DistTransport

        return DistTransport(self.links, master_address=address, tp_sizes=spec.tp_sizes, backend=spec.backend,
                             timeout_s=spec.timeout_s, fmt=fmt)

    @staticmethod
    def _metrics(stats: dict[str, float], total_s: float, delta: bool) -> dict[str, float]:
        moved = stats["bytes"]
        return {
            "sync/bytes": float(moved),
            "sync/raw_bytes": float(stats["raw_bytes"]),
            "sync/changed_frac": stats["changed"] / max(1, stats["numel"]),
            "sync/encode_s": stats["encode_s"],
            "sync/transfer_s": stats["transfer_s"],
            "sync/wait_s": stats["wait_s"],
            "sync/apply_s": stats["apply_s"],
            "sync/buckets": float(stats["buckets"]),
            "sync/in_place_buckets": float(stats["in_place_buckets"]),  # on every engine (raygym's server)
            "sync/adopted_buckets": float(stats["adopted_buckets"]),  # received into new regions (first syncs)
            "sync/setup_s": stats["setup_s"],  # one-time work: new memory allocated and first touched
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

    def push(self, version: int, weights: Iterable[tuple[str, torch.Tensor]], force_full: bool = False,
             refresh_snapshot: bool = True) -> dict[str, Any]:
        if self.sender is None:
            return drain(weights)
        kind = self.sender.spec.engine_kind  # names (a VLM's checkpoint names for SGLang) and MoE experts as it loads them
        named = moe_names.for_engine(names_for_engine(weights, kind), kind)
        return self.sender.push(version, named, force_full=force_full, refresh_snapshot=refresh_snapshot)

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
