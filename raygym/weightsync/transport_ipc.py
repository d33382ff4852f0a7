"""The ``ipc`` transport: trainer and engine share a GPU (colocate); CUDA IPC handles of each bucket go
to ``/update_weights_from_tensor`` and the engine maps the sender's memory, nothing is copied over a link.
Only full payloads (a delta saves nothing when only handles travel).

Per engine kind (``fmt``): raygym's server gets the bucket's manifest and buffer for raygym's loader;
stock SGLang gets the bucket's HF-named tensors (views into one CUDA buffer, so one handle per bucket)
with ``load_format`` unset, i.e. the model's own ``load_weights``. ``serialized_named_tensors`` holds one
entry per TP rank of the engine (SGLang's layout: rank ``i`` deserializes entry ``i``), and the device
in each handle is the GPU's UUID rather than its index, as SGLang's receivers expect: an index means
different GPUs in processes with different ``CUDA_VISIBLE_DEVICES``.

On CPU (colocate without GPUs) there is no CUDA IPC; :func:`make_colocated_transport` then falls back
to the ``nccl`` path, which runs on gloo.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from raygym.engine_api.protocol import Endpoint, UpdateWeightsFromTensor
from raygym.errors import WeightSyncError
from raygym.weightsync.codec import dtype_from_name
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, LOADER, MANIFEST_NAME, Manifest
from raygym.weightsync.transport_dist import DistTransport

# Position of the device index in the arguments torch's reduce_tensor gives rebuild_cuda_tensor.
DEVICE_ARG = 6


def with_device_uuid(args: tuple[Any, ...], uuid_of: Callable[[int], str]) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by that GPU's UUID.

    >>> with_device_uuid((0, 1, 2, 3, 4, 5, 1, 7), lambda i: f"GPU-{i}")
    (0, 1, 2, 3, 4, 5, 'GPU-1', 7)
    """
    out = list(args)
    out[DEVICE_ARG] = uuid_of(int(out[DEVICE_ARG]))
    return tuple(out)


def serialize_cuda_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, CUDA tensor) pairs as IPC handles naming devices by UUID, base64 text — the form
    SGLang's ``/update_weights_from_tensor`` deserializes."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    def reduce_by_uuid(tensor: torch.Tensor) -> Any:
        rebuild, args = reductions.reduce_tensor(tensor)
        if rebuild is reductions.rebuild_cuda_tensor:
            args = with_device_uuid(args, lambda i: str(torch.cuda.get_device_properties(i).uuid))
        return rebuild, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = dict(pickler.dispatch_table)
    pickler.dispatch_table[torch.Tensor] = reduce_by_uuid
    pickler.dispatch_table[torch.nn.Parameter] = reduce_by_uuid
    pickler.dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


class IpcTransport:
    """Sender side of the ``ipc`` transport (GPU only). ``tp_sizes[i]`` copies of the handles per engine."""

    kind = "ipc"

    def __init__(self, engines: list[EngineLink], *, tp_sizes: list[int] | None = None, timeout_s: float = 600.0,
                 fmt: str = "raygym_bucket"):
        if not torch.cuda.is_available():
            raise WeightSyncError("the ipc transport needs CUDA; on CPU use make_colocated_transport (gloo)")
        self.engines = list(engines)
        self.tp_sizes = list(tp_sizes) if tp_sizes else [1] * len(self.engines)
        self.timeout_s = float(timeout_s)
        self.fmt = fmt
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="raygym-ipc")

    @property
    def connected(self) -> bool:
        return True

    def close_group(self) -> None:
        """No connection state to drop."""

    def connect(self) -> None:
        """Nothing to set up: handles are created per bucket."""

    def begin(self, version: int) -> None:
        """Nothing to prepare per version."""

    def announce(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Nothing to start early: each bucket is handed over whole in :meth:`send_bucket`."""

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        on_gpu = flat.to(device)  # kept alive until every engine answered: the engines read this memory
        if self.fmt == "flattened_bucket":  # HF-named views of the one buffer: one handle per bucket
            tensors = [(e.name, on_gpu[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(tuple(e.shape)))
                       for e in Manifest.from_bytes(manifest).entries]
            load_format = None
        else:
            tensors = [(MANIFEST_NAME, manifest.to(device)), (BUCKET_NAME, on_gpu)]
            load_format = LOADER
        torch.cuda.synchronize(device)
        handles = serialize_cuda_tensors(tensors)
        futures = []
        for link, tp in zip(self.engines, self.tp_sizes, strict=True):
            request = UpdateWeightsFromTensor(serialized_named_tensors=[handles] * tp, load_format=load_format,
                                              flush_cache=False, weight_version=str(version))
            futures.append(self._pool.submit(checked, link, Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, request,
                                             self.timeout_s))
        failed = []
        for link, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=self.timeout_s)
            except Exception as exc:
                failed.append(f"{link.name} ({exc})")
        if failed:
            raise WeightSyncError(f"version {version}: engine(s) failed to load via CUDA IPC: {'; '.join(failed)}")

    def finish(self, version: int) -> None:
        """Every bucket was acknowledged as it went."""

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_colocated_transport(engines: list[EngineLink], *, tp_sizes: list[int] | None = None,
                             master_address: str = "127.0.0.1", timeout_s: float = 600.0,
                             fmt: str = "raygym_bucket"):
    """``IpcTransport`` on GPU; on CPU the gloo ``DistTransport`` (the only path that works there)."""
    if torch.cuda.is_available():
        return IpcTransport(engines, tp_sizes=tp_sizes, timeout_s=timeout_s, fmt=fmt)
    return DistTransport(engines, master_address=master_address, tp_sizes=tp_sizes, backend="gloo",
                         timeout_s=timeout_s, fmt=fmt)
