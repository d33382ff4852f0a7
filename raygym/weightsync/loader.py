"""Receiver side: apply raygym buckets to a model, then verify checksums. Runs inside the inference server.

``load_payload`` follows SGLang's custom weight-loader convention, ``fn(model, named_tensors)``: register it
with ``--custom-weight-loader raygym.weightsync.loader.load_payload`` and name it in ``load_format``.
``named_tensors`` holds pairs of uint8 tensors named ``__raygym_manifest__[.<key>]`` and
``__raygym_bucket__[.<key>]`` (see :mod:`raygym.weightsync.payload`); any other name is copied as a
full tensor into the parameter of that HF name (no checksum to verify then).

Loading is all or nothing: every name, shape and dtype is checked, every full payload's checksum too,
and deltas are applied with an undo log and checked; only when everything holds are the full tensors
written. On any failure the model is left exactly as it was and :class:`raygym.errors.WeightSyncError`
names the tensors, so the coordinator can trigger a full resync. A shadow copy
(:class:`raygym.weightsync.shadow.ShadowTarget`, double-buffered updates) is written directly instead:
nothing serves it, a failed update is discarded whole, and the coordinator verifies its checksums
before it is switched in, so checking them here too would only hash every tensor twice.

``load_payload_via_model`` (below) is the loader for engines whose parameters are fused and sharded
(stock SGLang): it keeps a host snapshot of HF-named tensors and hands full tensors to ``model.load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raygym.errors import WeightSyncError
from raygym.weightsync.codec import apply_delta, apply_delta_undoable, checksum, copy_bytes, dtype_from_name
from raygym.weightsync.payload import BUCKET_NAME, FULL, MANIFEST_NAME, unpack_bucket
from raygym.weightsync.shadow import ShadowTarget


@dataclass
class LoadReport:
    """What one ``load_payload`` call did."""

    tensors: int = 0
    payload_bytes: int = 0
    versions: set[int] = field(default_factory=set)
    names: list[str] = field(default_factory=list)


@dataclass
class _Transaction:
    """Writes waiting for the commit, and how to undo the deltas already applied."""

    writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (target, new value)
    undo: list[Callable[[], None]] = field(default_factory=list)
    direct: bool = False  # a shadow copy: write at once, no undo, no checksums (see the module docstring)

    def commit(self) -> None:
        for target, value in self.writes:
            target.copy_(value)

    def roll_back(self) -> None:
        for undo in reversed(self.undo):
            undo()


def load_payload(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
    """Apply every raygym bucket (and plain HF-named tensor) in ``named_tensors`` to ``model``, all or nothing.

    Raises ``WeightSyncError`` when a name is unknown, a shape/dtype differs, or the resulting bytes
    of a parameter would not match the sender's checksum; the model is then unchanged.
    """
    targets = named_targets(model)
    report = LoadReport()
    tx = _Transaction(direct=isinstance(model, ShadowTarget))
    manifests: dict[str, torch.Tensor] = {}
    buckets: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for name, tensor in named_tensors:
                kind, key = _split_name(name)
                if kind is None:
                    tx.writes.append((_checked_target(targets, name, tensor.shape, None), tensor))
                    report.tensors += 1
                    report.names.append(name)
                    continue
                (manifests if kind == MANIFEST_NAME else buckets)[key] = tensor
                if key in manifests and key in buckets:
                    _stage_bucket(targets, manifests.pop(key), buckets.pop(key), report, tx)
            if manifests or buckets:
                missing = sorted(set(manifests) ^ set(buckets))
                raise WeightSyncError(f"incomplete raygym bucket(s) {missing}: a manifest or a buffer is missing")
            tx.commit()
    except BaseException:
        tx.roll_back()
        raise
    return report


def named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the tensor to write: the model's state dict (parameters, tied names and persistent buffers)."""
    return {n: t.data if isinstance(t, torch.nn.Parameter) else t
            for n, t in model.state_dict(keep_vars=True).items()}


def named_holders(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the tensor object itself (a Parameter, buffer or shadow tensor), whose storage may be
    replaced (``holder.data = ...``); tied names map to one object."""
    return dict(model.state_dict(keep_vars=True))


def model_checksums(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, str]:
    """``codec.checksum`` of each named parameter (all when ``names`` is None), as the server reports them."""
    targets = named_targets(model)
    wanted = list(targets) if names is None else list(names)
    unknown = [n for n in wanted if n not in targets]
    if unknown:
        raise WeightSyncError(f"unknown parameter name(s) {unknown[:5]}")
    return {n: checksum(targets[n]) for n in wanted}


def _split_name(name: str) -> tuple[str | None, str]:
    for kind in (MANIFEST_NAME, BUCKET_NAME):
        if name == kind:
            return kind, ""
        if name.startswith(kind + "."):
            return kind, name[len(kind) + 1 :]
    return None, ""


def _checked_target(targets: dict[str, torch.Tensor], name: str, shape: torch.Size | list[int],
                    dtype: torch.dtype | None) -> torch.Tensor:
    try:
        target = targets[name]
    except KeyError:
        raise WeightSyncError(
            f"weight {name!r} has no parameter of that HF name in the engine's model; raygym payloads are "
            "applied by HF name (models that fuse parameters need update_weight_mode='full' with their own loader)"
        ) from None
    if list(target.shape) != list(shape) or (dtype is not None and target.dtype != dtype):
        raise WeightSyncError(
            f"weight {name!r}: payload is {list(shape)} {dtype or ''}, the engine holds "
            f"{list(target.shape)} {target.dtype}" + ("; send weights in the engine's dtype" if dtype else "")
        )
    return target


def _stage_bucket(
    targets: dict[str, torch.Tensor], manifest: torch.Tensor, flat: torch.Tensor, report: LoadReport,
    tx: _Transaction,
) -> None:
    try:
        m, parts = unpack_bucket(manifest.detach().cpu(), flat.detach().cpu())
    except ValueError as exc:
        raise WeightSyncError(f"corrupt raygym bucket: {exc}") from exc
    report.versions.add(m.version)
    for entry, payload in parts:
        try:
            dtype = dtype_from_name(entry.dtype)
        except ValueError as exc:
            raise WeightSyncError(f"weight {entry.name!r}: {exc}") from exc
        target = _checked_target(targets, entry.name, entry.shape, dtype)
        try:
            if entry.encoding == FULL:
                if payload.numel() != target.numel() * target.element_size():
                    raise ValueError(f"{payload.numel()} bytes for {target.numel()} elements of {dtype}")
                new = payload.view(dtype).reshape(target.shape)
                if tx.direct:
                    copy_bytes(target, new)
                else:
                    tx.writes.append((target, new))
            elif tx.direct:
                apply_delta(payload, target)
            else:
                tx.undo.append(apply_delta_undoable(payload, target))
                new = target
        except (ValueError, RuntimeError) as exc:
            raise WeightSyncError(f"weight {entry.name!r}: cannot apply {entry.encoding} payload: {exc}") from exc
        report.payload_bytes += entry.nbytes
        report.tensors += 1
        report.names.append(entry.name)
        if tx.direct:
            continue
        got = checksum(new)
        if got != entry.checksum:
            raise WeightSyncError(f"checksum mismatch after applying version {m.version}: {entry.name} "
                                  f"(expected {entry.checksum}, got {got})")


# ---------------------------------------------------------------------------------------------------------
# Engines whose parameters are fused and sharded (stock SGLang): a host snapshot of the HF-named tensors.


class HostSnapshot:
    """The HF-named tensors this engine process holds, in the dtypes they were sent in.

    ``apply`` builds the new tensors of one version without touching the snapshot or the model; ``commit``
    adopts them once the model has loaded them. So a failure leaves both exactly as they were.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Rebuild the full tensors of raygym buckets (full entries as sent, deltas on a copy of the
        snapshot's tensor); returns ``({name: new tensor}, {name: checksum})``; raises on any mismatch."""
        manifests: dict[str, torch.Tensor] = {}
        buckets: dict[str, torch.Tensor] = {}
        staged: dict[str, torch.Tensor] = {}
        digests: dict[str, str] = {}
        for name, tensor in named_tensors:
            kind, key = _split_name(name)
            if kind is None:
                raise WeightSyncError(f"{name!r}: load_payload_via_model takes raygym buckets only")
            (manifests if kind == MANIFEST_NAME else buckets)[key] = tensor
            if key in manifests and key in buckets:
                self._stage_bucket(manifests.pop(key), buckets.pop(key), staged, digests)
        if manifests or buckets:
            raise WeightSyncError(f"incomplete raygym bucket(s) {sorted(set(manifests) ^ set(buckets))}")
        return staged, digests

    def _stage_bucket(self, manifest: torch.Tensor, flat: torch.Tensor, staged: dict[str, torch.Tensor],
                      digests: dict[str, str]) -> None:
        m, parts = unpack_bucket(manifest.detach().cpu(), flat.detach().cpu())
        for entry, payload in parts:
            dtype = dtype_from_name(entry.dtype)
            if entry.encoding == FULL:
                new = payload.view(dtype).reshape(entry.shape).clone()
            else:
                old = staged.get(entry.name, self.tensors.get(entry.name))
                if old is None:
                    raise WeightSyncError(f"delta for {entry.name!r} but this engine holds no snapshot of it "
                                          "(restarted?); a full sync is needed")
                new = old.clone()
                apply_delta(payload, new)
            got = checksum(new)
            if got != entry.checksum:
                raise WeightSyncError(f"checksum mismatch for {entry.name!r} in version {m.version}: "
                                      f"expected {entry.checksum}, got {got}")
            staged[entry.name] = new
            digests[entry.name] = got

    def commit(self, staged: dict[str, torch.Tensor]) -> None:
        self.tensors.update(staged)


_HOST_SNAPSHOT = HostSnapshot()  # one per engine process (each TP rank has its own)


class WeightLoadingModel(Protocol):
    """An engine's model that takes HF-named tensors and fuses and shards them itself (SGLang's models)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


def load_payload_via_model(model: WeightLoadingModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader for delta payloads: read the version directory a pointer names,
    rebuild full HF-named tensors from this process's host snapshot, hand them to ``model.load_weights``
    (the model fuses and shards them itself), then write an acknowledgement with their checksums.

    Never raises: an exception inside SGLang's scheduler ends the engine. A failure is written to the
    acknowledgement instead (the model and the snapshot stay as they were) and the sender reports it.
    """
    import json

    import fsspec

    from raygym.weightsync.tensor_pickle import POINTER_NAME
    from raygym.weightsync.transport_disk import ack_file, read_version_dir

    pointer: dict[str, Any] = {}
    ack: dict[str, object]
    try:
        items = list(named_tensors)
        if len(items) != 1 or items[0][0] != POINTER_NAME:
            raise WeightSyncError(f"expected one {POINTER_NAME} tensor, got {[n for n, _ in items][:3]}")
        pointer = json.loads(bytes(items[0][1].cpu().numpy().tobytes()).decode())
        staged, digests = _HOST_SNAPSHOT.apply(read_version_dir(str(pointer["url"])))
        with torch.no_grad():
            model.load_weights(list(staged.items()))
        _HOST_SNAPSHOT.commit(staged)
        ack = {"ok": True, "version": pointer.get("version"), "checksums": digests}
    except Exception as exc:  # reported through the acknowledgement, never raised (see the docstring)
        ack = {"ok": False, "version": pointer.get("version"), "error": f"{type(exc).__name__}: {exc}"}
    if "url" not in pointer:
        return  # nowhere to report; the sender finds no acknowledgement and fails the sync
    try:
        fs, root = fsspec.core.url_to_fs(str(pointer["url"]))
        with fs.open(f"{root}/{ack_file(int(pointer['engine']), _tp_rank())}", "w") as f:
            f.write(json.dumps(ack))
    except Exception:  # an unwritable directory: the sender finds no acknowledgement and fails the sync
        pass


def _tp_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
