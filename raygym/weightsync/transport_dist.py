"""The ``nccl`` transport: a dedicated torch.distributed group (gloo when there is no GPU).

Rank 0 is the sender (trainer rank 0); engine ``i`` joins at ``rank_offset = 1 + sum of the TP sizes
of engines before it`` through its ``/init_weights_update_group`` endpoint. Engines are asked to join
in a fixed order, the group is created with an explicit timeout, and every broadcast and every HTTP
answer is awaited with a timeout: an engine that does not join or answer becomes a ``WeightSyncError``
naming it, never a silent hang.

Per bucket the sender posts ``/update_weights_from_distributed`` with two uint8 tensors (manifest,
flat buffer) and ``load_format = raygym.weightsync.loader:load_payload``, then broadcasts them.
The receiver half (:func:`join_group`, :func:`broadcast`) is shared with engines and tests.
"""

from __future__ import annotations

import datetime
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, LOADER, MANIFEST_NAME

GROUP_PROTOCOLS = ("sglang", "raygym")


def join_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
    timeout_s: float, protocol: str = "sglang",
) -> Any:
    """Create (or join) the weight-update process group; returns the ProcessGroup object.

    ``protocol="sglang"``: the rendezvous of SGLang's ``init_custom_process_group`` (tcp store at the
    master, ``_new_process_group_helper`` with the group name), so a stock SGLang engine and a raygym
    sender meet in one group. ``protocol="raygym"``: the scheme raygym's built-in server uses today
    (``raygym.rollout.server.new_process_group``: store prefix = group name, then a barrier).
    The caller's default process group is neither needed nor touched.
    """
    if protocol == "raygym":
        from raygym.rollout.server import new_process_group

        return new_process_group(master_address=master_address, master_port=master_port, rank=rank,
                                 world_size=world_size, group_name=group_name, backend=backend,
                                 timeout_s=timeout_s).pg
    if protocol != "sglang":
        raise ValueError(f"group protocol {protocol!r}: use one of {GROUP_PROTOCOLS}")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    return pg


def broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from rank 0 of ``pg`` in place, waiting at most ``timeout_s`` seconds."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    work = pg.broadcast([tensor], opts)
    if not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise TimeoutError(f"broadcast of {tensor.numel()} bytes did not finish in {timeout_s}s")


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class DistTransport:
    """Sender side of the ``nccl`` (or ``gloo``) transport.

    >>> t = DistTransport(links, master_address="127.0.0.1", timeout_s=30)  # doctest: +SKIP
    >>> t.connect(); t.send_bucket(1, manifest, flat); t.close()           # doctest: +SKIP
    """

    kind = "nccl"

    def __init__(
        self, engines: list[EngineLink], *, master_address: str = "127.0.0.1", tp_sizes: list[int] | None = None,
        backend: str | None = None, timeout_s: float = 600.0, protocol: str = "sglang",
    ):
        self.engines = list(engines)
        self.tp_sizes = list(tp_sizes) if tp_sizes else [1] * len(self.engines)
        if len(self.tp_sizes) != len(self.engines):
            raise ValueError(f"tp_sizes has {len(self.tp_sizes)} entries for {len(self.engines)} engines")
        self.master_address = master_address
        self.backend = backend or default_backend()
        self.timeout_s = float(timeout_s)
        self.protocol = protocol
        self.group_name = ""
        self._pg: Any = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="raygym-ws")

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def connect(self) -> None:
        """Ask every engine to join (fixed order), join as rank 0, and name any engine that did not."""
        self.close_group()
        port = free_port(self.master_address)
        self.group_name = f"raygym_ws_{uuid.uuid4().hex[:8]}"
        world = 1 + sum(self.tp_sizes)
        futures: list[Future] = []
        offset = 1
        for link, tp in zip(self.engines, self.tp_sizes, strict=True):
            payload = {"master_address": self.master_address, "master_port": port, "rank_offset": offset,
                       "world_size": world, "group_name": self.group_name, "backend": self.backend}
            futures.append(self._pool.submit(checked, link, "init_weights_update_group", payload, self.timeout_s))
            offset += tp
        try:
            pg = join_group(self.master_address, port, 0, world, self.group_name, self.backend, self.timeout_s,
                            self.protocol)
        except Exception as exc:
            failed = self._failed(futures, grace_s=1.0)
            names = ", ".join(failed) or "unknown (every engine answered; check their logs)"
            raise WeightSyncError(
                f"weight-update group {self.group_name} ({self.master_address}:{port}, world {world}) was not "
                f"formed within update_weight_timeout={self.timeout_s}s; engine(s) that did not join: {names} "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from exc
        failed = self._failed(futures, grace_s=self.timeout_s)
        if failed:
            raise WeightSyncError(f"engine(s) failed to join weight-update group {self.group_name}: {', '.join(failed)}")
        self._pg = pg

    def begin(self, version: int) -> None:
        if self._pg is None:
            self.connect()

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Post the receive request to every engine, broadcast manifest then buffer, await every answer."""
        if self._pg is None:
            raise WeightSyncError("weight-update group is not connected; call connect() first")
        payload = {"names": [MANIFEST_NAME, BUCKET_NAME], "dtypes": ["uint8", "uint8"],
                   "shapes": [[int(manifest.numel())], [int(flat.numel())]], "group_name": self.group_name,
                   "flush_cache": False, "weight_version": str(version), "load_format": LOADER}
        futures = [self._pool.submit(checked, link, "update_weights_from_distributed", payload, self.timeout_s)
                   for link in self.engines]
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        try:
            for tensor in (manifest, flat):
                broadcast(self._pg, tensor.to(device), self.timeout_s)
        except Exception as exc:
            self._pg = None  # a failed collective leaves the group unusable; reconnect next time
            failed = self._failed(futures, grace_s=1.0)
            raise WeightSyncError(
                f"broadcast of version {version} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                f"engine(s) that did not receive: {', '.join(failed) or 'unknown'}"
            ) from exc
        failed = self._failed(futures, grace_s=self.timeout_s)
        if failed:
            raise WeightSyncError(f"version {version}: engine(s) failed to load a bucket: {'; '.join(failed)}")

    def finish(self, version: int) -> None:
        """Nothing to do: every bucket was acknowledged as it went."""

    def close_group(self) -> None:
        """Leave the current group (engines are asked to destroy theirs; failures are ignored)."""
        if self._pg is None:
            return
        for link in self.engines:
            try:
                link.call("destroy_weights_update_group", {"group_name": self.group_name}, min(self.timeout_s, 10.0))
            except Exception:
                pass
        self._pg = None

    def close(self) -> None:
        self.close_group()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _failed(self, futures: list[Future], grace_s: float) -> list[str]:
        """Names (with reasons) of engines whose request failed or is still pending after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        failed = []
        for link, fut in zip(self.engines, futures, strict=True):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                failed.append(f"{link.name} (no answer within {grace_s:.0f}s)")
            except Exception as exc:
                failed.append(f"{link.name} ({exc})")
        return failed
