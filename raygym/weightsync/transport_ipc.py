"""The ``ipc`` transport: trainer and engine share a GPU (colocate); CUDA IPC handles of each bucket go
to SGLang's ``/update_weights_from_tensor`` and the engine maps the sender's memory, nothing is copied
over a link. Only full payloads (a delta saves nothing when only handles travel).

On CPU (colocate without GPUs) there is no CUDA IPC; :func:`make_colocated_transport` then falls back
to the ``nccl`` path, which runs on gloo.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import torch

from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, LOADER, MANIFEST_NAME
from raygym.weightsync.transport_dist import DistTransport


def serialize_cuda_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, CUDA tensor) pairs as IPC handles, base64 text — the form SGLang deserializes."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA-IPC reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode()


class IpcTransport:
    """Sender side of the ``ipc`` transport (GPU only). ``tp_sizes[i]`` copies of the handles per engine."""

    kind = "ipc"

    def __init__(self, engines: list[EngineLink], *, tp_sizes: list[int] | None = None, timeout_s: float = 600.0):
        if not torch.cuda.is_available():
            raise WeightSyncError("the ipc transport needs CUDA; on CPU use make_colocated_transport (gloo)")
        self.engines = list(engines)
        self.tp_sizes = list(tp_sizes) if tp_sizes else [1] * len(self.engines)
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="raygym-ipc")

    @property
    def connected(self) -> bool:
        return True

    def connect(self) -> None:
        """Nothing to set up: handles are created per bucket."""

    def begin(self, version: int) -> None:
        """Nothing to prepare per version."""

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        # Keep both alive until every engine answered: the engine reads this very memory.
        tensors = [(MANIFEST_NAME, manifest.to(device)), (BUCKET_NAME, flat.to(device))]
        torch.cuda.synchronize(device)
        handles = serialize_cuda_tensors(tensors)
        futures = []
        for link, tp in zip(self.engines, self.tp_sizes, strict=True):
            payload = {"serialized_named_tensors": [handles] * tp, "load_format": LOADER, "flush_cache": False,
                       "weight_version": str(version)}
            futures.append(self._pool.submit(checked, link, "update_weights_from_tensor", payload, self.timeout_s))
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
                             master_address: str = "127.0.0.1", timeout_s: float = 600.0):
    """``IpcTransport`` on GPU; on CPU the gloo ``DistTransport`` (the only path that works there)."""
    if torch.cuda.is_available():
        return IpcTransport(engines, tp_sizes=tp_sizes, timeout_s=timeout_s)
    return DistTransport(engines, master_address=master_address, tp_sizes=tp_sizes, backend="gloo",
                         timeout_s=timeout_s)
