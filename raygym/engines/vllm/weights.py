"""raygym's weight-transfer backend for vLLM: runs inside vLLM's worker processes.

vLLM updates weights in sessions (``start_weight_update``, ``update_weights`` per chunk,
``finish_weight_update``) driven through its engine (``AsyncLLM``), with a pluggable transfer backend
registered in ``WeightTransferEngineFactory`` and chosen by ``weight_transfer_config.backend``. This module
registers raygym's backend, ``"raygym"``, when it is imported: vLLM imports it in every worker process because
raygym's adapter (:mod:`raygym.engines.vllm.server`) names :class:`RaygymWorkerExtension`, defined here, as
vLLM's ``worker_extension_cls``.

The backend speaks raygym's transports, so the trainer needs no vLLM:

- ``init_transfer_engine``: join the trainer's weight-update group at ``rank_offset`` + this worker's TP rank
  (raygym's rendezvous, :func:`raygym.weightsync.transport_dist.join_group`; gloo on CPU, NCCL on GPU);
- ``start_weight_update`` / ``finish_weight_update``: vLLM's layerwise reload around the session, so a layer
  is re-processed (fused, sharded, repacked for the CPU kernels) once all its checkpoint tensors arrived,
  whichever chunk brought them;
- ``receive_weights``: one chunk from ``source`` = ``group`` (a broadcast), ``disk`` (a directory written by
  raygym's disk transport, or any HF safetensors checkpoint directory) or ``tensors`` (pickled named tensors:
  CUDA IPC handles on a shared GPU), with ``payload`` = ``flattened`` / ``tensors`` (HF-named full tensors) or
  ``raygym`` (raygym buckets, full or delta: rebuilt into full tensors from the host snapshot this worker
  keeps of what it loaded). Full tensors go to the model's own ``load_weights``, which takes the trainer's
  in-memory names and a saved checkpoint's alike (vLLM's ``hf_to_vllm_mapper``: for Qwen2.5-VL
  ``model.language_model.*`` / ``model.*`` -> ``language_model.model.*``, ``model.visual.*`` -> ``visual.*``,
  ``lm_head.*`` -> ``language_model.lm_head.*``).

Verification: each worker keeps the xxh3 checksum of every HF-named full tensor it handed to ``load_weights``
(:meth:`RaygymWorkerExtension.raygym_received_checksums`, asked inside the session; a chunk counts once it loaded),
which raygym's sync coordinator compares exactly with the sender's through ``/raygym/weights_checksum``.
vLLM's own parameters are fused, sharded and (on CPU) repacked, so what loading does with those tensors is
left to the log-prob probe.

A chunk that fails is recorded and reported through :meth:`RaygymWorkerExtension.raygym_take_failure`
(which the adapter asks after every chunk); the session still ends normally (layers not loaded keep their
weights), nothing of that version enters the snapshot, and the sync coordinator resyncs in full.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from raygym.engines.serving.weight_receiver import destroy_group
from raygym.engines.vllm.idle import bound_reader_spin_from_env
from raygym.engines.vllm.vision import install_stand_ins_from_env
from raygym.errors import WeightSyncError
from raygym.weightsync.codec import checksum, dtype_from_name
from raygym.weightsync.loader import HostSnapshot
from raygym.weightsync.tensor_pickle import loads_named_tensors
from raygym.weightsync.transport_dist import join_group, receive_flattened, receive_tensors

bound_reader_spin_from_env()  # this module loads in every worker before its batch queue is made
install_stand_ins_from_env()  # ... and before it builds the model (vision checkpoints without torchvision)

BACKEND = "raygym"
SOURCES = ("group", "disk", "tensors")
PAYLOADS = ("flattened", "tensors", "raygym")


@dataclass
class RaygymInitInfo(WeightTransferInitInfo):
    """``/init_weights_update_group``'s fields (this worker joins at ``rank_offset`` + its TP rank)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class RaygymUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of a weight update (see the module docstring for ``source`` and ``payload``)."""

    source: str
    payload: str
    group_name: str = ""
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    url: str = ""
    serialized: list[str] = field(default_factory=list)  # one entry per TP rank
    ack_engine: int = -1  # >= 0: write raygym's disk acknowledgement for this engine index
    version: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES or self.payload not in PAYLOADS:
            raise ValueError(f"source={self.source!r}, payload={self.payload!r}: use one of {SOURCES} / {PAYLOADS}")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, "
                             f"{len(self.shapes)})")


class RaygymWeightTransferEngine(WeightTransferEngine[RaygymInitInfo, RaygymUpdateInfo]):
    """vLLM's weight-transfer engine interface over raygym's transports (one per vLLM worker)."""

    init_info_cls = RaygymInitInfo
    update_info_cls = RaygymUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups: dict[str, tuple[Any, str]] = {}  # name -> (process group, backend)
        self.snapshot = HostSnapshot()
        self._staged: dict[str, torch.Tensor] = {}
        self.received: dict[str, str] = {}  # HF name -> checksum of the tensor last loaded under that name
        self._received_staged: dict[str, str] = {}
        self._reloading = False
        self.failure = ""  # why a chunk of the open session failed
        self.timeout_s = 600.0
        if device.type == "cpu":
            from raygym.engines.vllm.moe_repack import install

            install()

    # ----- groups -----
    def init_transfer_engine(self, init_info: RaygymInitInfo) -> None:
        if init_info.group_name in self.groups:
            raise WeightSyncError(f"group {init_info.group_name!r} already exists; destroy it first")
        if init_info.backend == "nccl" and self.device.type != "cuda":
            raise WeightSyncError("backend='nccl' needs a CUDA worker; use backend='gloo' on CPU")
        self.timeout_s = init_info.timeout_s
        rank = init_info.rank_offset + _tp_rank()
        pg = join_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                        init_info.group_name, init_info.backend, init_info.timeout_s)
        self.groups[init_info.group_name] = (pg, init_info.backend)

    def shutdown(self) -> None:
        for name, (pg, _) in list(self.groups.items()):
            destroy_group(pg, name)
        self.groups.clear()

    # ----- sessions -----
    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._staged, self._received_staged, self.failure = {}, {}, ""
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def finish_weight_update(self) -> None:
        """Never raises: vLLM's worker would stay inside the session (a failed chunk was already reported
        through :meth:`take_failure`, and then nothing of this version enters the snapshot)."""
        if self._reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
        if not self.failure:
            self.snapshot.commit(self._staged)  # only now: every chunk of this version was loaded
            self.received.update(self._received_staged)
        self._staged, self._received_staged, self.failure = {}, {}, ""

    def take_failure(self) -> str:
        """Why a chunk of the open session failed ("" when none did); the adapter asks after every chunk."""
        return self.failure

    # ----- chunks -----
    def receive_weights(self, update_info: RaygymUpdateInfo) -> None:
        """Receive one chunk and load it. A failure is recorded, not raised, and later chunks of the session
        are still received (a broadcast must not wait for a receiver that left) but not loaded: vLLM ends
        the worker's session on an exception, and the trainer would then broadcast into the void."""
        try:
            named = self._receive(update_info)
            if self.failure:
                return
            if not self._reloading:
                raise WeightSyncError("update_weights outside a weight-update session: call start_weight_update first")
            acks: dict[str, str] = {}
            if update_info.payload == "raygym":
                staged, acks = self.snapshot.apply(named)
                named = list(staged.items())
                self._staged.update(staged)
            digests = {name: checksum(t) for name, t in named}  # what the model is handed (a delta rebuilt in full)
            with torch.no_grad():
                self.model.load_weights(named)
            self._received_staged.update(digests)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if update_info.ack_engine >= 0:
                _write_ack(update_info.url, update_info.ack_engine, update_info.version, acks)
        except Exception as exc:
            self.failure = self.failure or f"{type(exc).__name__}: {exc}"

    def _receive(self, info: RaygymUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        if info.source == "group":
            if info.group_name not in self.groups:
                raise WeightSyncError(f"group_name={info.group_name!r}: no such group; join it first")
            pg, backend = self.groups[info.group_name]
            specs = [(n, dtype_from_name(d), list(s)) for n, d, s in zip(info.names, info.dtypes, info.shapes,
                                                                            strict=True)]
            device = self.device if backend == "nccl" else torch.device("cpu")
            if info.payload == "flattened":
                return receive_flattened(pg, specs, device, self.timeout_s)
            return list(receive_tensors(pg, specs, device, self.timeout_s))
        if self.failure:
            return []  # nothing to drain
        if info.source == "disk":
            if info.payload == "raygym":
                from raygym.weightsync.transport_disk import read_version_dir

                return list(read_version_dir(info.url))
            return list(read_checkpoint_dir(info.url))
        if not info.serialized:
            raise WeightSyncError("serialized_named_tensors is empty: one entry per TP rank is expected")
        text = info.serialized[min(_tp_rank(), len(info.serialized) - 1)]
        return tensors_on_this_gpu(text, self.device) if self.device.type == "cuda" else loads_named_tensors(text)


class RaygymWorkerExtension:
    """vLLM's ``worker_extension_cls`` for raygym: importing this module in a worker registers the ``raygym``
    weight-transfer backend there. Also answers what a test or an operator may ask a worker."""

    def raygym_take_failure(self) -> str:
        """Why the last chunk of the open weight update failed on this worker ("" when it did not)."""
        return self._raygym_engine().take_failure()

    def raygym_received_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """Checksums of the HF-named tensors this worker's weight updates loaded (the latest of each name;
        ``names``: only those); see the module docstring."""
        engine = self._raygym_engine()
        received = {**engine.received, **engine._received_staged}  # the sync coordinator asks inside the session
        return received if names is None else {n: received[n] for n in names if n in received}

    def _raygym_engine(self) -> RaygymWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, RaygymWeightTransferEngine):
            raise WeightSyncError("this vLLM worker was not started with weight_transfer_config backend 'raygym'")
        return engine


def read_checkpoint_dir(url: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF-named tensors of a safetensors checkpoint directory on any fsspec URL: a version directory of
    raygym's disk transport (its ``manifest.json`` lists the shards, ``DONE`` marks it complete) or a plain
    Hugging Face checkpoint (every ``*.safetensors`` file)."""
    import fsspec

    from raygym.weightsync.transport_disk import DONE_FILE, MANIFEST_FILE, read_shard

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if fs.exists(f"{root}/{MANIFEST_FILE}"):
        if not fs.exists(f"{root}/{DONE_FILE}"):
            raise WeightSyncError(f"{url}: no {DONE_FILE} marker; the version directory is incomplete")
        files = [f"{root}/{s['file']}" for s in json.loads(fs.cat_file(f"{root}/{MANIFEST_FILE}"))["shards"]]
    else:
        files = sorted(fs.glob(f"{root}/*.safetensors"))
        if not files:
            raise WeightSyncError(f"{url}: no *.safetensors files and no raygym manifest")
    for path in files:
        yield from read_shard(fs.cat_file(path)).items()


def tensors_on_this_gpu(text: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Named CUDA tensors from raygym's IPC pickle (:func:`raygym.weightsync.transport_ipc.serialize_cuda_tensors`),
    opened on ``device``: the handles name the GPU by UUID, which must be this worker's (colocated)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from raygym.weightsync.transport_ipc import DEVICE_ARG

    index = device.index if device.index is not None else torch.cuda.current_device()
    here = str(torch.cuda.get_device_properties(index).uuid)

    def rebuild_here(*args: Any) -> torch.Tensor:
        if str(args[DEVICE_ARG]) != here:
            raise WeightSyncError(f"CUDA IPC handle for GPU {args[DEVICE_ARG]}, but this worker runs on {here}: "
                                  "the ipc transport needs trainer and engine on the same GPU (colocate)")
        fixed = list(args)
        fixed[DEVICE_ARG] = index
        return rebuild_cuda_tensor(*fixed)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return rebuild_here
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if (module, name) in {("torch", "Size"), ("torch._utils", "_rebuild_tensor_v2")}:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"serialized_named_tensors: {module}.{name} is not allowed here")

    value = Unpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
    if not isinstance(value, list) or not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in value):
        raise WeightSyncError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return value


def _write_ack(url: str, engine: int, version: str, digests: dict[str, str]) -> None:
    """raygym's disk acknowledgement (what ``DiskTransport`` checks for its ``tensor_pointer`` route)."""
    import fsspec

    from raygym.weightsync.transport_disk import ack_file

    fs, root = fsspec.core.url_to_fs(url)
    with fs.open(f"{root.rstrip('/')}/{ack_file(engine, _tp_rank())}", "w") as f:
        f.write(json.dumps({"ok": True, "version": version, "checksums": digests}))


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def register() -> None:
    """Register the ``raygym`` backend in vLLM's weight-transfer factory (once per process)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, RaygymWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


register()
