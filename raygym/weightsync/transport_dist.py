"""The ``nccl`` transport: a dedicated torch.distributed group (gloo when there is no GPU).

Rank 0 is the sender (trainer rank 0); engine ``i`` joins at ``rank_offset = 1 + sum of the TP sizes
of engines before it`` through its ``/init_weights_update_group`` endpoint. Engines are asked to join
in a fixed order, the group is created with an explicit timeout, and every broadcast and every HTTP
answer is awaited with a timeout: an engine that does not join or answer becomes a ``WeightSyncError``
naming it, never a silent hang.

Per bucket the sender posts ``/update_weights_from_distributed`` and then broadcasts, in one of two formats:

- ``raygym_bucket`` (raygym's server): two uint8 tensors (manifest, flat buffer) with
  ``load_format = raygym.weightsync.loader.load_payload``, which applies full or delta entries by HF name;
- ``flattened_bucket`` (stock SGLang): the bucket's HF-named tensors as ``names``/``dtypes``/``shapes`` and
  ONE broadcast of their bytes back to back (SGLang's ``FlattenedTensorBucket`` layout), which SGLang hands
  to the model's own ``load_weights`` (fusing and TP sharding are the model's business).

The receiver half (:func:`join_group`, :func:`broadcast`, :func:`receive_tensors`,
:func:`receive_flattened`) is shared with raygym's server, the in-process receiver and tests. Engines answer
each bucket's request after loading it; the sender awaits those answers one bucket late, so loading
overlaps the next bucket.
"""

from __future__ import annotations

import datetime
import math
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NamedTuple, cast

import torch

from raygym.engine_api.protocol import (
    FLATTENED_BUCKET,
    DestroyWeightsUpdateGroup,
    Endpoint,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
    WeightUpdateResult,
)
from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import BUCKET_NAME, FULL, LOADER, MANIFEST_NAME, Manifest

FORMATS = ("raygym_bucket", FLATTENED_BUCKET)


def join_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str,
    timeout_s: float, store: Any = None,
) -> Any:
    """Create (rank 0) or join the weight-update process group; returns the ProcessGroup object.

    The rendezvous of SGLang's ``init_custom_process_group`` (and slime's copy of it): a TCP store hosted
    by rank 0 at ``master_address:master_port``, its keys namespaced by ``PrefixStore(group_name, ...)``,
    then a process group named ``group_name`` on it. Stock SGLang, raygym's server and this sender all
    meet this way, in either role. The store and the group both get ``timeout_s``; the caller's default
    process group is neither needed nor touched. IPv6 addresses may come bare or in brackets. Rank 0 may
    pass the ``store`` it already hosts (:func:`host_store`).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from raygym.cluster.netif import pin_gloo_interface

    deadline = time.monotonic() + timeout_s  # one budget for both phases: the join ends within timeout_s
    if backend == "gloo":  # bind the interface that reaches the master, never a loopback the host name names
        pin_gloo_interface(master_address)

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(0.5, deadline - time.monotonic()))

    if store is None:
        store, _, _ = next(dist.rendezvous(tcp_url(master_address, master_port), rank, world_size, timeout=left()))
    store.set_timeout(left())
    store = dist.PrefixStore(group_name, store)
    # torch has no public API for a group outside the default world; SGLang uses this helper too.
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store,
                                           group_name=cast("c10d.GroupName", group_name),
                                           timeout=datetime.timedelta(seconds=timeout_s))
    # SGLang's receivers call torch.distributed.broadcast(src=0, group=pg), which maps ranks through this table.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def host_store(address: str, world_size: int, timeout_s: float) -> tuple[Any, int]:
    """Rank 0's rendezvous store listening on a port the OS picks on ``address`` (no race with another
    process for a port found free a moment before); returns (store, port)."""
    import torch.distributed as dist

    store = dist.TCPStore(address.strip("[]"), 0, world_size, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, int(store.port)


def tcp_url(address: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 hosts in brackets.

    >>> tcp_url("10.0.0.1", 29500), tcp_url("fe80::1", 29500), tcp_url("[fe80::1]", 29500)
    ('tcp://10.0.0.1:29500', 'tcp://[fe80::1]:29500', 'tcp://[fe80::1]:29500')
    """
    host = address.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from rank 0 of ``pg`` in place; raises ``TimeoutError`` after ``timeout_s``.

    Both the collective and the wait carry the timeout: a peer that never shows up is an error, not a hang.
    """
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    work = pg.broadcast([tensor], opts)
    try:
        done = work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo reports its own timeout as a RuntimeError
        raise TimeoutError(f"broadcast of {tensor.numel() * tensor.element_size()} bytes failed or did not "
                           f"finish in {timeout_s}s: {str(exc)[:300]}") from exc
    if done is False:
        raise TimeoutError(f"broadcast of {tensor.numel() * tensor.element_size()} bytes did not finish in {timeout_s}s")


def receive_tensors(
    pg: Any, specs: list[tuple[str, torch.dtype, list[int]]], device: torch.device, timeout_s: float,
    scratch: ScratchBuffers | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive one ``/update_weights_from_distributed`` request's tensors, in order, each with a timeout.

    Lazily: a tensor is received when the consumer asks for the next one. With ``scratch``, CPU tensors
    land in reused memory (valid until the next request) instead of fresh pages.
    """
    for index, (name, dtype, shape) in enumerate(specs):
        if scratch is not None and device.type == "cpu":
            tensor = scratch.get(index, dtype, shape)
        else:
            tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        broadcast(pg, tensor, timeout_s)
        yield name, tensor


def receive_flattened(
    pg: Any, specs: list[tuple[str, torch.dtype, list[int]]], device: torch.device, timeout_s: float,
    scratch: ScratchBuffers | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive one ``flattened_bucket`` request: ONE broadcast of the tensors' bytes back to back, in
    ``specs`` order; returns views into the received buffer (SGLang's ``FlattenedTensorBucket`` layout)."""
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    total = sum(sizes)
    if scratch is not None and device.type == "cpu":
        flat = scratch.get(0, torch.uint8, [total])
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    broadcast(pg, flat, timeout_s)
    out, offset = [], 0
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"flattened_bucket: {name!r} starts at byte {offset}, not a multiple of its "
                             f"{dtype} item size; the sender must keep tensors aligned")
        out.append((name, flat[offset:offset + size].view(dtype).view(tuple(shape))))
        offset += size
    return out


class ScratchBuffers:
    """Per-position receive buffers reused across requests (a receiver handles one request at a time).

    At most ``max_bytes`` are kept (raygym's buckets are two tensors of at most a bucket each);
    anything beyond, e.g. a whole model sent tensor by tensor in one request, gets fresh memory
    that is freed after the request.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._bufs: dict[int, torch.Tensor] = {}

    def get(self, index: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._bufs.get(index)
        if buf is None or buf.numel() < nbytes:
            kept = sum(b.numel() for i, b in self._bufs.items() if i != index)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if kept + nbytes <= self.max_bytes:
                self._bufs[index] = buf
            else:
                self._bufs.pop(index, None)
        return buf[:nbytes].view(dtype).view(tuple(shape))


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class _Announced(NamedTuple):
    """A packed bucket that will be sent next, and its engines' requests once posted."""

    flat: torch.Tensor
    payload: UpdateWeightsFromDistributed
    tensors: list[torch.Tensor]
    futures: list[Future] | None


class DistTransport:
    """Sender side of the ``nccl`` (or ``gloo``) transport.

    >>> t = DistTransport(links, master_address="127.0.0.1", timeout_s=30)  # doctest: +SKIP
    >>> t.connect(); t.send_bucket(1, manifest, flat); t.close()           # doctest: +SKIP
    """

    kind = "nccl"

    def __init__(
        self, engines: list[EngineLink], *, master_address: str = "127.0.0.1", tp_sizes: list[int] | None = None,
        backend: str | None = None, timeout_s: float = 600.0, fmt: str = "raygym_bucket",
    ):
        if fmt not in FORMATS:
            raise ValueError(f"fmt={fmt!r}: one of {FORMATS}")
        self.fmt = fmt
        self.engines = list(engines)
        self.tp_sizes = list(tp_sizes) if tp_sizes else [1] * len(self.engines)
        if len(self.tp_sizes) != len(self.engines):
            raise ValueError(f"tp_sizes has {len(self.tp_sizes)} entries for {len(self.engines)} engines")
        self.master_address = master_address
        self.backend = backend or default_backend()
        self.timeout_s = float(timeout_s)
        self._unanswered: list[tuple[int, list[Future]]] = []  # (version, futures) of sent buckets
        self.apply_s = [0.0] * len(self.engines)  # per engine, this push: seconds its loads took (its answers)
        self.in_place_buckets = [0] * len(self.engines)  # per engine, this push: buckets received into the weights
        self.adopted_buckets = [0] * len(self.engines)  # ... into a fresh region that became the weights' storage
        self.setup_s = [0.0] * len(self.engines)  # per engine, this push: one-time seconds (fresh regions)
        self.group_name = ""
        self._pg: Any = None
        # Three buckets' requests are open at once per engine: k-1 awaiting its answer, k on the wire, and k+1,
        # posted once k's manifest is through (see :meth:`announce`), so it is queued at the engine by the time
        # k's buffer is received instead of travelling while the group waits.
        self._pool = ThreadPoolExecutor(max_workers=max(1, 3 * len(self.engines)), thread_name_prefix="raygym-ws")
        self._order = threading.Lock()  # guards the two fields below (the packing and the sending thread)
        self._announced: deque[_Announced] = deque()
        self._may_post_next = False  # the bucket on the wire has reached every engine: the next may be posted

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def connect(self) -> None:
        """Ask every engine to join (fixed order), join as rank 0, and name any engine that did not."""
        self.close_group()
        self.group_name = f"raygym_ws_{uuid.uuid4().hex[:8]}"
        world = 1 + sum(self.tp_sizes)
        try:
            store, port = host_store(self.master_address, world, self.timeout_s)
        except Exception as exc:
            raise WeightSyncError(f"cannot host the weight-update rendezvous on {self.master_address}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        futures: list[Future] = []
        offset = 1
        for link, tp in zip(self.engines, self.tp_sizes, strict=True):
            # an engine's TP ranks join at rank_offset + tp_rank: offsets advance by each engine's TP size
            join = InitWeightsUpdateGroup(master_address=self.master_address, master_port=port, rank_offset=offset,
                                          world_size=world, group_name=self.group_name,
                                          backend=self.backend)  # type: ignore[arg-type]
            futures.append(self._pool.submit(checked, link, Endpoint.INIT_WEIGHTS_UPDATE_GROUP, join, self.timeout_s))
            offset += tp
        try:
            pg = join_group(self.master_address, port, 0, world, self.group_name, self.backend, self.timeout_s,
                            store=store)
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
        with self._order:
            self._announced.clear()
            self._may_post_next = False
        self.apply_s = [0.0] * len(self.engines)
        self.in_place_buckets = [0] * len(self.engines)
        self.adopted_buckets = [0] * len(self.engines)
        self.setup_s = [0.0] * len(self.engines)

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Post the receive request to every engine (unless :meth:`announce` already did), broadcast manifest
        then buffer.

        Returns once the bytes are on the wire; the engines' answers are awaited one bucket later
        (while they load bucket k the sender already packs k+1) and all of them in :meth:`finish`.
        Request k+1 is posted only after every engine joined bucket k's first broadcast, so every engine sees
        them in order (see :meth:`announce`).
        """
        if self._pg is None:
            raise WeightSyncError("weight-update group is not connected; call connect() first")
        with self._order:
            self._may_post_next = False
            if self._announced and self._announced[0].flat is flat:
                _, payload, tensors, futures = self._announced.popleft()
            else:
                (payload, tensors), futures = self._request(version, manifest, flat), None
            if futures is None:
                futures = self._post(payload)
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        try:
            for i, tensor in enumerate(tensors):
                broadcast(self._pg, tensor.to(device), self.timeout_s)
                if i == 0:  # every engine is in this request now: the next one may travel meanwhile
                    self._post_next()
        except Exception as exc:
            self._pg = None  # a failed collective leaves the group unusable; reconnect next time
            failed = self._failed(futures, grace_s=1.0)
            self._unanswered.clear()
            with self._order:
                self._announced.clear()
            raise WeightSyncError(
                f"broadcast of version {version} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                f"engine(s) that did not receive: {', '.join(failed) or 'unknown'}"
            ) from exc
        self._unanswered.append((version, futures))
        while len(self._unanswered) > 1:
            self._await_answers()

    def announce(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Bucket ``flat`` is packed and follows the ones announced before it: its requests are posted as soon as
        the bucket before it has reached every engine (its manifest broadcast is through), so an engine finds
        request k+1 queued when it has received bucket k. Posting later would keep every engine and the group
        waiting a request's round trip per bucket. Requests reach each engine in bucket order: a gloo root's
        broadcast returns only once every receiver joined it (measured: a root broadcasting 100 bytes waits for a
        receiver that joins 1 s late), so request k arrived before k+1 is posted. On NCCL nothing is announced."""
        if self.backend != "gloo":
            return  # a NCCL root may finish its broadcast before the engines joined: nothing says k arrived
        payload, tensors = self._request(version, manifest, flat)
        with self._order:
            early = not self._announced and self._may_post_next
            self._announced.append(_Announced(flat, payload, tensors, self._post(payload) if early else None))
            if early:
                self._may_post_next = False

    def _post_next(self) -> None:
        with self._order:
            if self._announced and self._announced[0].futures is None:
                self._announced[0] = self._announced[0]._replace(futures=self._post(self._announced[0].payload))
            else:
                self._may_post_next = not self._announced

    def _post(self, request: UpdateWeightsFromDistributed) -> list[Future]:
        return [self._pool.submit(checked, link, Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, request, self.timeout_s)
                for link in self.engines]

    def _request(self, version: int, manifest: torch.Tensor, flat: torch.Tensor
                 ) -> tuple[UpdateWeightsFromDistributed, list[torch.Tensor]]:
        """The ``/update_weights_from_distributed`` request of one bucket and the tensors to broadcast."""
        if self.fmt == "flattened_bucket":
            entries = Manifest.from_bytes(manifest).entries
            assert all(e.encoding == FULL for e in entries), "flattened buckets carry full tensors only"
            return (UpdateWeightsFromDistributed(
                names=[e.name for e in entries], dtypes=[e.dtype for e in entries],
                shapes=[list(e.shape) for e in entries], load_format=FLATTENED_BUCKET, group_name=self.group_name,
                flush_cache=False, weight_version=str(version)), [flat])
        return (UpdateWeightsFromDistributed(
            names=[MANIFEST_NAME, BUCKET_NAME], dtypes=["uint8", "uint8"],
            shapes=[[int(manifest.numel())], [int(flat.numel())]], load_format=LOADER, group_name=self.group_name,
            flush_cache=False, weight_version=str(version)), [manifest, flat])

    def finish(self, version: int) -> None:
        """Wait for every engine's answer to every bucket of ``version``."""
        while self._unanswered:
            self._await_answers()

    def _await_answers(self) -> None:
        version, futures = self._unanswered.pop(0)
        failed = self._failed(futures, grace_s=self.timeout_s)
        if failed:
            self._unanswered.clear()
            raise WeightSyncError(f"version {version}: engine(s) failed to load a bucket: {'; '.join(failed)}")
        for i, fut in enumerate(futures):
            answer: WeightUpdateResult = fut.result()
            self.apply_s[i] += answer.apply_s
            self.in_place_buckets[i] += int(answer.in_place)
            self.adopted_buckets[i] += int(answer.adopted)
            self.setup_s[i] += answer.setup_s

    def close_group(self) -> None:
        """Leave the current group (engines are asked to destroy theirs; failures are ignored)."""
        if self._pg is None:
            return
        for link in self.engines:
            try:
                link.call(Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, DestroyWeightsUpdateGroup(group_name=self.group_name),
                          min(self.timeout_s, 10.0))
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
