"""Receiver side: apply raygym buckets to a model, then verify checksums. Runs inside the inference server.

``load_payload`` follows SGLang's custom weight-loader convention, ``fn(model, named_tensors)``: register it
with ``--custom-weight-loader raygym.weightsync.loader:load_payload`` and name it in ``load_format``.
``named_tensors`` holds pairs of uint8 tensors named ``__raygym_manifest__[.<key>]`` and
``__raygym_bucket__[.<key>]`` (see :mod:`raygym.weightsync.payload`); any other name is copied as a
full tensor into the parameter of that HF name (no checksum to verify then).

Each entry is written into the parameter with the same HF name (full copy, or a delta overwrite) and
the parameter's resulting bytes are checked against the sender's checksum; a mismatch raises
:class:`raygym.errors.WeightSyncError` naming the tensors, so the coordinator can trigger a full resync.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from raygym.errors import WeightSyncError
from raygym.weightsync.codec import apply_delta, checksum, dtype_from_name
from raygym.weightsync.payload import BUCKET_NAME, FULL, MANIFEST_NAME, unpack_bucket


@dataclass
class LoadReport:
    """What one ``load_payload`` call did."""

    tensors: int = 0
    payload_bytes: int = 0
    versions: set[int] = field(default_factory=set)
    names: list[str] = field(default_factory=list)


def load_payload(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
    """Apply every raygym bucket (and plain HF-named tensor) in ``named_tensors`` to ``model``.

    Raises ``WeightSyncError`` when a name is unknown, a shape/dtype differs, or the resulting bytes
    of a parameter do not match the sender's checksum.
    """
    targets = named_targets(model)
    report = LoadReport()
    manifests: dict[str, torch.Tensor] = {}
    buckets: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        kind, key = _split_name(name)
        if kind is None:
            _copy_plain(targets, name, tensor)
            report.tensors += 1
            report.names.append(name)
            continue
        (manifests if kind == MANIFEST_NAME else buckets)[key] = tensor
        if key in manifests and key in buckets:
            _apply_bucket(targets, manifests.pop(key), buckets.pop(key), report)
    if manifests or buckets:
        missing = sorted(set(manifests) ^ set(buckets))
        raise WeightSyncError(f"incomplete raygym bucket(s) {missing}: a manifest or a buffer is missing")
    return report


def named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the tensor to write: the model's state dict (parameters, tied names and persistent buffers)."""
    return {n: t.data if isinstance(t, torch.nn.Parameter) else t
            for n, t in model.state_dict(keep_vars=True).items()}


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


def _target(targets: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return targets[name]
    except KeyError:
        raise WeightSyncError(
            f"weight {name!r} has no parameter of that HF name in the engine's model; raygym payloads are "
            "applied by HF name (models that fuse parameters need update_weight_mode='full' with their own loader)"
        ) from None


def _copy_plain(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    target = _target(targets, name)
    if target.shape != tensor.shape:
        raise WeightSyncError(f"weight {name!r}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}")
    target.copy_(tensor)


def _apply_bucket(
    targets: dict[str, torch.Tensor], manifest: torch.Tensor, flat: torch.Tensor, report: LoadReport
) -> None:
    try:
        m, parts = unpack_bucket(manifest.detach().cpu(), flat.detach().cpu())
    except ValueError as exc:
        raise WeightSyncError(f"corrupt raygym bucket: {exc}") from exc
    report.versions.add(m.version)
    written = []
    for entry, payload in parts:
        target = _target(targets, entry.name)
        dtype = dtype_from_name(entry.dtype)
        if target.dtype != dtype or list(target.shape) != list(entry.shape):
            raise WeightSyncError(
                f"weight {entry.name!r}: payload is {entry.shape} {entry.dtype}, the engine holds "
                f"{list(target.shape)} {target.dtype}; send weights in the engine's dtype"
            )
        try:
            if entry.encoding == FULL:
                target.copy_(payload.view(dtype).reshape(target.shape))
            else:
                apply_delta(payload, target)
        except (ValueError, RuntimeError) as exc:
            raise WeightSyncError(f"weight {entry.name!r}: cannot apply {entry.encoding} payload: {exc}") from exc
        written.append((entry, target))
        report.payload_bytes += entry.nbytes
    bad = [(e.name, e.checksum, got) for e, t in written if (got := checksum(t)) != e.checksum]
    if bad:
        detail = ", ".join(f"{n} (expected {want}, got {got})" for n, want, got in bad[:5])
        raise WeightSyncError(f"checksum mismatch after applying version {m.version}: {len(bad)} tensor(s): {detail}")
    report.tensors += len(written)
    report.names.extend(e.name for e, _ in written)
