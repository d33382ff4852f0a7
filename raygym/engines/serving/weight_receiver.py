"""Engine side of weight sync, independent of any web framework: what an inference server does on
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/destroy_weights_update_group``, ``/get_weights_by_name`` and
``/raygym/weights_checksum`` for a model whose parameters carry HF names.

raygym's server delegates those endpoints here (it adds HTTP, ordering and the model lock); tests and
benchmarks run it in plain processes or Ray actors as a receiver that does not generate (so
pause/continue/flush are trivially successful). Request bodies are the models of
:mod:`raygym.engine_api.protocol`; answers are SGLang's ``{"success", "message"}``.

Every update loaded by copy is all or nothing (see :mod:`raygym.weightsync.loader`): names, shapes and
dtypes are checked and tensors staged before anything is written, so a failed update leaves the weights
and the version label as they were, and says so.

Distributed requests are pipelined (:meth:`WeightReceiver.submit_distributed`): bucket k+1 is received
into a second scratch buffer while bucket k is loaded, in order. A full raygym bucket whose layout the
weights already have (:mod:`raygym.weightsync.in_place`: adopted after the first full load) is received
straight into the weights instead: no scratch, no copy, no hashing on the receive path. Its bytes are
checked by the coordinator's checksum comparison, which runs before generation continues; a broadcast
that fails part way through leaves the weights labelled :data:`INCOMPLETE` until a full sync succeeds.
Double-buffered updates (``/raygym/shadow_begin`` ... ``/raygym/shadow_switch``,
:mod:`raygym.weightsync.shadow`) load into a shadow copy while the model keeps serving, and are verified
there before the switch.

>>> r = WeightReceiver(model)                                   # doctest: +SKIP
>>> r.update_weights_from_disk(model_path="/shared/v000003", load_format=LOADER, weight_version="3")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from raygym.callables import load_callable
from raygym.engine_api import protocol
from raygym.weightsync import in_place, loader
from raygym.weightsync.codec import checksum, dtype_from_name
from raygym.weightsync.payload import BUCKET_NAME, LOADER, MANIFEST_NAME, Manifest
from raygym.weightsync.shadow import ShadowWeights
from raygym.weightsync.sources import WeightSources
from raygym.weightsync.tensor_pickle import loads_named_tensors
from raygym.weightsync.transport_dist import (
    ScratchBuffers,
    broadcast,
    join_group,
    receive_flattened,
    receive_tensors,
)

Loader = Callable[[torch.nn.Module, Iterable[tuple[str, torch.Tensor]]], Any]
_JOINS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="raygym-join")
DEFAULT_FORMATS = (None, "", "auto", "safetensors", "default", "direct")
RECEIVE_DEPTH = 2  # buckets in the engine at once: one being received, one being loaded
INCOMPLETE = "incomplete"  # the weight version after an in-place receive failed part way (a full sync repairs it)


class WeightRequestError(ValueError):
    """A request this engine refuses before touching anything (answered with HTTP 400)."""


def _dotted(path: str) -> str:
    return path.replace(":", ".")


def import_loader(path: str) -> Loader:
    """The custom weight loader ``pkg.mod:fn`` or ``pkg.mod.fn`` (ConfigError when it does not import)."""
    loaded = load_callable(path, "custom_weight_loader")
    assert loaded is not None
    return loaded


def copy_by_name(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The default loader: copy tensors into the parameters of the same HF name, all or nothing (every
    name and shape is checked before the first copy); dtypes are cast to the parameter's."""
    targets = loader.named_targets(model)
    staged, unknown, mismatched = [], [], []
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            unknown.append(name)
        elif tuple(target.shape) != tuple(tensor.shape):
            mismatched.append(f"{name}: got {tuple(tensor.shape)}, model has {tuple(target.shape)}")
        else:
            staged.append((target, tensor))
    if unknown or mismatched:
        problems = []
        if unknown:
            problems.append(f"unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        if mismatched:
            problems.append(f"shape mismatch {mismatched[:5]}")
        raise WeightRequestError("; ".join(problems) + " (names must be the HF checkpoint's state-dict names); "
                                 "nothing was loaded")
    with torch.no_grad():
        for target, tensor in staged:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))


@dataclass(frozen=True)
class InPlaceBucket:
    """A full bucket already received into the weights (served, or the shadow copy when ``shadowed``), or,
    with ``fresh``, into a new region that becomes their storage once it is checked."""

    manifest: Manifest
    shadowed: bool
    fresh: torch.Tensor | None = None
    alloc_s: float = 0.0  # seconds spent allocating and first touching ``fresh``


Received = list[tuple[str, torch.Tensor]] | InPlaceBucket


@dataclass(frozen=True)
class JoinedGroup:
    """A weight-update process group this engine joined."""

    pg: Any
    backend: str


class WeightReceiver:
    """Receives weights into ``model`` (on ``device``) and reports checksums by HF name.

    ``exclusive``: a context manager factory that holds the model while it is written, ``reading`` one that
    holds it while it is read (raygym's server passes its generation engine's locks; default: none).
    ``sources``: where ``model_path`` may point.
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu", weight_version: str = "0",
                 custom_loaders: Iterable[str] = (LOADER,), timeout_s: float = 600.0, *,
                 exclusive: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                 reading: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                 sources: WeightSources | None = None):
        self.model = model
        self.device = torch.device(device)
        self.weight_version = str(weight_version)
        self.loaders = {_dotted(p): import_loader(p) for p in custom_loaders}
        self.timeout_s = timeout_s
        self.exclusive = exclusive or contextlib.nullcontext
        self.reading = reading or contextlib.nullcontext
        self.sources = sources or WeightSources()
        self.groups: dict[str, JoinedGroup] = {}
        self.session_open = False
        self.last_apply_s = 0.0
        self.in_place_buckets = 0  # full buckets received straight into the weights (no scratch, no copy)
        self.adopted_buckets = 0  # full buckets received into a fresh region that became their tensors' storage
        self.shadow = ShadowWeights(model)
        self._shadow_version: str | None = None
        # Two scratch sets: bucket k+1 is received into one while bucket k is loaded from the other.
        self._scratch: queue.Queue[ScratchBuffers] = queue.Queue()
        for _ in range(RECEIVE_DEPTH):
            self._scratch.put(ScratchBuffers())
        self._receiving: ThreadPoolExecutor | None = None
        self._loading: ThreadPoolExecutor | None = None

    # ----- loaders -----
    def resolve_loader(self, load_format: str | None) -> Loader:
        """The loader ``load_format`` names: the default copy by HF name, or one registered at start-up."""
        if load_format in DEFAULT_FORMATS:
            return copy_by_name
        found = self.loaders.get(_dotted(load_format or ""))
        if found is None:
            raise WeightRequestError(
                f"load_format={load_format!r}: not a registered custom weight loader; registered: "
                f"{sorted(self.loaders) or 'none'} (start the server with --custom-weight-loader {load_format})")
        return found

    # ----- groups -----
    def init_weights_update_group(self, **body: Any) -> dict[str, Any]:
        req = protocol.InitWeightsUpdateGroup.model_validate(body)
        if req.group_name in self.groups:
            return _fail(f"group {req.group_name!r} already exists; destroy it first")
        if req.rank_offset >= req.world_size:
            return _fail(f"rank_offset={req.rank_offset} is outside world_size={req.world_size}")
        if req.rank_offset == 0:
            return _fail("rank_offset=0: rank 0 is the sender, which hosts the rendezvous store; an engine "
                         "joins at rank_offset >= 1")
        if req.backend == "nccl" and not torch.cuda.is_available():
            return _fail("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        # torch's rendezvous can overrun its timeout (client retries); the answer comes within it regardless,
        # and a join that completes after the answer was given up on is left again at once.
        joining = _JOINS.submit(join_group, req.master_address, req.master_port, req.rank_offset, req.world_size,
                                req.group_name, req.backend, self.timeout_s)
        try:
            pg = joining.result(timeout=self.timeout_s)
        except FutureTimeout:
            def leave_late_join(f: Future[Any]) -> None:
                if f.exception() is None:
                    destroy_group(f.result(), req.group_name)

            joining.add_done_callback(leave_late_join)
            return _fail(f"Failed to init group {req.group_name!r}: not formed within {self.timeout_s} s "
                         f"(master {req.master_address}:{req.master_port}, world_size {req.world_size})")
        except Exception as exc:
            return _fail(f"Failed to init group {req.group_name!r}: {type(exc).__name__}: {exc}")
        self.groups[req.group_name] = JoinedGroup(pg, req.backend)
        return _ok(f"Succeeded to initialize custom process group {req.group_name!r} "
                   f"(rank {req.rank_offset} of {req.world_size}).")

    def destroy_weights_update_group(self, **body: Any) -> dict[str, Any]:
        req = protocol.DestroyWeightsUpdateGroup.model_validate(body)
        group = self.groups.pop(req.group_name, None)
        if group is None:
            return _fail(f"group {req.group_name!r} does not exist")
        destroy_group(group.pg, req.group_name)
        return _ok(f"Succeeded to destroy custom process group {req.group_name!r}.")

    def close(self) -> None:
        for pool in (self._receiving, self._loading):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._receiving = self._loading = None
        for name, group in list(self.groups.items()):
            destroy_group(group.pg, name)
        self.groups.clear()

    # ----- sessions (SGLang >= 0.5.23 wraps updates in them; raygym accepts them and does not require them) -----
    def begin_weight_update(self, **body: Any) -> dict[str, Any]:
        protocol.BeginWeightUpdate.model_validate(body)
        if self.session_open:
            return _fail("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return _ok("Success")

    def end_weight_update(self, **body: Any) -> dict[str, Any]:
        if not self.session_open:
            return _fail("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return _ok("Success")

    # ----- updates -----
    def receive_distributed(self, req: protocol.UpdateWeightsFromDistributed,
                            scratch: ScratchBuffers | None = None) -> Received:
        """Receive one request's tensors (the sender is broadcasting them) into ``scratch`` (reused memory,
        valid until the scratch is used again) or fresh memory; a full raygym bucket goes straight into the
        weights when they have its layout, else into a fresh region that will become their storage (an
        :class:`InPlaceBucket` either way). A bad request raises WeightRequestError."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise WeightRequestError(f"group_name={req.group_name!r}: no such group; call /init_weights_update_group first")
        if not len(req.names) == len(req.dtypes) == len(req.shapes):
            raise WeightRequestError(f"names, dtypes and shapes must have the same length "
                                     f"({len(req.names)}, {len(req.dtypes)}, {len(req.shapes)})")
        try:
            dtypes = [dtype_from_name(d) for d in req.dtypes]
        except ValueError as exc:
            raise WeightRequestError(f"dtypes: {exc}") from exc
        if any(d < 0 for shape in req.shapes for d in shape):
            raise WeightRequestError(f"shapes={req.shapes!r}: dimensions must be >= 0")
        specs = list(zip(req.names, dtypes, req.shapes, strict=True))
        device = self.device if group.backend == "nccl" else torch.device("cpu")
        if req.load_format == protocol.FLATTENED_BUCKET:
            return receive_flattened(group.pg, specs, device, self.timeout_s, scratch)
        if _dotted(req.load_format or "") == _dotted(LOADER) and req.names == [MANIFEST_NAME, BUCKET_NAME]:
            return self._receive_bucket(group.pg, specs, device, scratch)
        return list(receive_tensors(group.pg, specs, device, self.timeout_s, scratch))

    def _receive_bucket(self, pg: Any, specs: list[tuple[str, torch.dtype, list[int]]], device: torch.device,
                        scratch: ScratchBuffers | None) -> Received:
        """A raygym bucket: the manifest first, then the flat buffer into the weights when their layout
        matches (:func:`raygym.weightsync.in_place.bucket_region`), else into scratch like any request."""
        tensors = receive_tensors(pg, specs, device, self.timeout_s, scratch)
        name, manifest_bytes = next(tensors)
        try:
            manifest: Manifest | None = Manifest.from_bytes(manifest_bytes.cpu())
        except (ValueError, KeyError, TypeError):
            manifest = None  # the loader reports it; the buffer must still be received (the group stays in step)
        shadowed = self.shadow.open
        if manifest is None or manifest.total_bytes != math.prod(specs[1][2]):
            return [(name, manifest_bytes), *tensors]
        holders = loader.named_holders(self._write_target())
        region = in_place.bucket_region(manifest, holders, device)
        if region is None:
            if not in_place.adoptable(manifest, holders, device):
                return [(name, manifest_bytes), *tensors]
            start = time.perf_counter()
            try:  # touched now (zeroed), so the one-time cost of new memory is measured apart from the wire
                fresh = torch.zeros(manifest.total_bytes, dtype=torch.uint8, device=device)
            except (RuntimeError, MemoryError):  # no room for a region now: receive into scratch and copy
                return [(name, manifest_bytes), *tensors]
            alloc_s = time.perf_counter() - start
            broadcast(pg, fresh, self.timeout_s)  # new memory: the weights are untouched until it is checked
            return InPlaceBucket(manifest, shadowed, fresh, alloc_s)
        if shadowed:
            self.shadow.written()
            broadcast(pg, region, self.timeout_s)
        else:
            with self.exclusive():
                self.shadow.served_changed()
                try:
                    broadcast(pg, region, self.timeout_s)
                except BaseException:
                    self.weight_version = INCOMPLETE  # part of the served bytes were overwritten
                    raise
        self.in_place_buckets += 1
        return InPlaceBucket(manifest, shadowed)

    def _write_target(self) -> torch.nn.Module:
        """Where loads go now: the shadow copy during a double-buffered update, else the served model."""
        return self.shadow.target() if self.shadow.open else self.model

    def submit_distributed(self, **body: Any) -> Future[dict[str, Any]]:
        """Start one ``/update_weights_from_distributed`` request; its answer arrives in the future.

        Requests are received in submission order on one thread and loaded in the same order on another,
        so bucket k+1 comes off the wire while bucket k is checked and applied. Submit requests in the order
        the sender posts them (its k+1 only follows once bucket k is on the wire)."""
        answer: Future[dict[str, Any]] = Future()
        try:
            req = protocol.UpdateWeightsFromDistributed.model_validate(body)
            fn = copy_by_name if req.load_format == protocol.FLATTENED_BUCKET else self.resolve_loader(req.load_format)
        except ValueError as exc:
            answer.set_result(_fail(f"Failed to update weights: {exc}"))
            return answer
        if self._receiving is None or self._loading is None:
            self._receiving = ThreadPoolExecutor(1, thread_name_prefix="raygym-recv")
            self._loading = ThreadPoolExecutor(1, thread_name_prefix="raygym-load")
        loading = self._loading

        def load(received: Received, scratch: ScratchBuffers) -> None:
            try:
                if isinstance(received, InPlaceBucket):
                    answer.set_result(self._settle_in_place(received, req.weight_version))
                    return
                answer.set_result(self.load(received, fn, req.weight_version))
            except BaseException as exc:  # the answer must come whatever happens
                answer.set_result(_fail(f"Failed to update weights: {type(exc).__name__}: {exc}"))
            finally:
                self._scratch.put(scratch)

        def receive() -> None:
            scratch = self._scratch.get()  # free once the load two buckets back is done
            try:
                received = self.receive_distributed(req, scratch)
            except WeightRequestError as exc:
                self._scratch.put(scratch)
                answer.set_result(_fail(f"Failed to update weights: {exc}"))
                return
            except Exception as exc:
                self._scratch.put(scratch)
                answer.set_result(_fail(f"Failed to receive weights: {type(exc).__name__}: {exc}; weight_version "
                                        f"{self.weight_version!r}"))
                return
            loading.submit(load, received, scratch)

        self._receiving.submit(receive)
        return answer

    def _settle_in_place(self, bucket: InPlaceBucket, weight_version: str | None) -> dict[str, Any]:
        """The answer to a bucket received in place: its bytes are already the weights (verified by the
        coordinator's checksum comparison); move the version label as a load would. A bucket received into a
        fresh region is checked first (all or nothing, as a load by copy) and its region becomes the storage
        of its tensors: the layout is adopted, so the next bucket like it is received in place."""
        start = time.perf_counter()
        if bucket.shadowed != self.shadow.open:  # the double-buffered update was discarded meanwhile
            return _fail("Failed to update weights: the shadow update this bucket belongs to was discarded",
                         num_paused_requests=0)
        if bucket.fresh is not None:
            if not bucket.shadowed:  # a shadow is verified by the coordinator before it is switched in
                bad = [e.name for e in bucket.manifest.entries
                       if checksum(bucket.fresh[e.offset : e.offset + e.nbytes]) != e.checksum]
                if bad:
                    return _fail(f"Failed to update weights: checksum mismatch for {bad[:3]}; the served weights "
                                 f"and weight_version {self.weight_version!r} are unchanged", num_paused_requests=0)
            with contextlib.nullcontext() if bucket.shadowed else self.exclusive():
                in_place.adopt_region(bucket.manifest, loader.named_holders(self._write_target()), bucket.fresh)
                if bucket.shadowed:
                    self.shadow.written()
                else:
                    self.shadow.served_changed()
            self.adopted_buckets += 1
        self.last_apply_s = time.perf_counter() - start
        adopted = bucket.fresh is not None
        # setup_s: the one-time part (a region allocated, touched, checked and adopted), not a cost of later syncs
        timing = {"apply_s": self.last_apply_s, "setup_s": bucket.alloc_s + self.last_apply_s if adopted else 0.0}
        if bucket.shadowed:
            self._shadow_version = None if weight_version is None else str(weight_version)
            return _ok("Received the bucket into the shadow copy; /raygym/shadow_switch serves it.",
                       num_paused_requests=0, in_place=not adopted, adopted=adopted, **timing)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return _ok(f"Received the bucket into the model weights. Weight version updated to {self.weight_version}.",
                   num_paused_requests=0, in_place=not adopted, adopted=adopted, **timing)

    def update_weights_from_distributed(self, **body: Any) -> dict[str, Any]:
        """Receive and load one request (waits for the requests submitted before it)."""
        return self.submit_distributed(**body).result()

    def update_weights_from_disk(self, **body: Any) -> dict[str, Any]:
        req = protocol.UpdateWeightsFromDisk.model_validate(body)
        try:
            fn = self.resolve_loader(req.load_format)
            tensors = self.sources.read(req.model_path)
        except WeightRequestError as exc:
            return _fail(f"Failed to update weights from {req.model_path}: {exc}", num_paused_requests=0)
        except ValueError as exc:
            return _fail(f"Failed to update weights: {exc}", num_paused_requests=0)
        return self.load(tensors, fn, req.weight_version, source=req.model_path)

    def update_weights_from_tensor(self, **body: Any) -> dict[str, Any]:
        req = protocol.UpdateWeightsFromTensor.model_validate(body)
        try:
            if req.load_format == protocol.FLATTENED_BUCKET:
                raise WeightRequestError("load_format='flattened_bucket' is not accepted on /update_weights_from_tensor "
                                         "by raygym's server; send (name, tensor) pairs")
            fn = self.resolve_loader(req.load_format)
            if not req.serialized_named_tensors:
                raise WeightRequestError("serialized_named_tensors is empty: one entry per TP rank is expected")
            tensors = loads_named_tensors(req.serialized_named_tensors[0])  # this server is TP rank 0 of 1
        except ValueError as exc:
            return _fail(f"Failed to update weights: {exc}")
        return self.load(tensors, fn, req.weight_version)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]], fn: Loader, weight_version: str | None,
             source: str | None = None) -> dict[str, Any]:
        """Apply ``tensors`` with ``fn`` under the model lock; the version label moves only on success.

        During a double-buffered update the tensors go to the shadow instead, without the lock (generation
        never reads the shadow); the label moves at the switch."""
        start = time.perf_counter()
        shadowed = self.shadow.open
        try:
            if shadowed:
                self.shadow.written()
                with torch.no_grad():
                    fn(self.shadow.target(), tensors)
            else:
                self.shadow.served_changed()
                with self.exclusive(), torch.no_grad():
                    fn(self.model, tensors)
        except Exception as exc:  # a corrupt shard, a checksum or shape mismatch: nothing was applied
            where = f" from {source}" if source else ""
            return _fail(f"Failed to update weights{where}: {type(exc).__name__}: {exc}; the served weights and "
                         f"weight_version {self.weight_version!r} are unchanged", num_paused_requests=0)
        self.last_apply_s = time.perf_counter() - start
        message = "Succeeded to update model weights."
        if shadowed:
            self._shadow_version = None if weight_version is None else str(weight_version)
            message = "Succeeded to load weights into the shadow copy; /raygym/shadow_switch serves them."
        elif weight_version is not None:
            self.weight_version = str(weight_version)
            message += f" Weight version updated to {self.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0, "apply_s": self.last_apply_s}

    # ----- double-buffered updates -----
    def shadow_begin(self, **body: Any) -> dict[str, Any]:
        """Send the following updates to the shadow copy (allocated on first use, brought up to the served
        weights here unless ``full``: every tensor the update sends is rewritten); the model keeps serving.
        A shadow update already open is abandoned first."""
        req = protocol.ShadowBegin.model_validate(body)
        self.shadow.discard()
        self._shadow_version = None
        try:
            catch_up_s = self.shadow.begin(full=req.full)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of memory for the second copy
            self.shadow.discard()
            return _fail(f"Failed to prepare the shadow copy: {type(exc).__name__}: {exc}")
        return _ok("Shadow copy ready; updates now load into it.", catch_up_s=catch_up_s,
                   shadow_bytes=self.shadow.nbytes)

    def shadow_switch(self, hold: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                      **body: Any) -> dict[str, Any]:
        """Serve the shadow copy: swap it in while ``hold()`` holds the model (raygym's server: between two
        decode steps) and move the version label; ``switch_s`` is how long the model was held."""
        req = protocol.ShadowSwitch.model_validate(body)
        if not self.shadow.open:
            return _fail("no shadow update is open; call /raygym/shadow_begin and load weights first")
        version = req.weight_version if req.weight_version is not None else self._shadow_version
        start = time.perf_counter()
        with (hold or self.exclusive)():
            held = time.perf_counter()
            self.shadow.switch()
            if version is not None:
                self.weight_version = str(version)
            done = time.perf_counter()
        self._shadow_version = None
        return _ok(f"Switched to the shadow copy; weight version {self.weight_version}.",
                   switch_s=done - held, wait_s=held - start, weight_version=self.weight_version)

    def shadow_discard(self, **body: Any) -> dict[str, Any]:
        """Abandon a shadow update (the served weights never changed)."""
        self.shadow.discard()
        self._shadow_version = None
        return _ok("Shadow update discarded.")

    # ----- reads -----
    def weights_checksum(self, **body: Any) -> dict[str, Any]:
        req = protocol.WeightsChecksum.model_validate(body)
        if req.shadow:  # what the switch would serve; generation never touches the shadow
            if not self.shadow.open:
                raise WeightRequestError("shadow=true: no shadow update is open")
            return {"weight_version": self._shadow_version, "checksums":
                    loader.model_checksums(self.shadow.target(), req.names)}
        with self.reading():
            return {"weight_version": self.weight_version, "checksums": loader.model_checksums(self.model, req.names)}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first ``truncate_size`` rows of the tensor ``name`` as lists (SGLang's answer)."""
        targets = loader.named_targets(self.model)
        if name not in targets:
            raise WeightRequestError(f"name={name!r}: no parameter of that HF name")
        with self.reading():
            return targets[name][:truncate_size].float().cpu().tolist()

    # A receiver does not generate: these endpoints exist so a coordinator can drive it like an engine.
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return {"success": True}

    def continue_generation(self) -> dict[str, Any]:
        return {"success": True}

    def flush_cache(self) -> dict[str, Any]:
        return {"success": True}

    def abort_request(self, abort_all: bool = True, rid: str = "") -> dict[str, Any]:
        return {"success": True}

    def model_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "model_path": "", "is_generation": True}


def destroy_group(pg: Any, name: str) -> None:
    """Leave a process group and free its name so a group of the same name can be created again."""
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a peer already gone; nothing left to release
        dist.destroy_process_group(pg)
    # destroy_process_group leaves the name in torch's registry for groups outside the default world
    unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
    if unregister is not None:
        with contextlib.suppress(Exception):
            unregister(name)


def _ok(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": True, "message": message, **extra}


def _fail(message: str, **extra: Any) -> dict[str, Any]:
    return {"success": False, "message": message, **extra}

