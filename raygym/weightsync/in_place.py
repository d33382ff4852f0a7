"""Full buckets received straight into the weights they replace: no scratch buffer, no copy.

raygym's bucket (:mod:`raygym.weightsync.payload`) is one flat buffer whose entries start at fixed,
aligned offsets. The first time an engine gets a full bucket it receives it into a fresh region, checks
it, and :func:`adopt_region` makes that bucket's tensors views of the region (no copy; the old storage
is freed). From then on :func:`bucket_region` finds the region for a bucket of the same layout, and the
broadcast lands in the weights themselves: each engine touches the bytes once (the kernel's receive)
instead of three times (receive, hash, copy).

A region is used only when it holds nothing but this bucket's tensors at the manifest's offsets, so
receiving the whole buffer (padding included) writes no other tensor. Works on any device: on a GPU the
region is device memory and NCCL writes into it.

>>> import torch
>>> from raygym.weightsync.payload import encode_tensor, pack_bucket, Manifest
>>> model = torch.nn.Linear(4, 2)
>>> manifest, _ = pack_bucket([encode_tensor(n, t) for n, t in model.state_dict().items()], version=1)
>>> m = Manifest.from_bytes(manifest)
>>> holders = model.state_dict(keep_vars=True)
>>> bucket_region(m, holders, torch.device("cpu")) is None      # separate tensors: not yet
True
>>> region = torch.empty(m.total_bytes, dtype=torch.uint8)      # the bucket is received here ...
>>> adoptable(m, holders, torch.device("cpu")); adopt_region(m, holders, region)
True
>>> bucket_region(m, holders, torch.device("cpu")).data_ptr() == region.data_ptr()  # ... and next time in place
True
"""

from __future__ import annotations

import torch

from raygym.weightsync.codec import dtype_from_name
from raygym.weightsync.payload import FULL, Manifest, ManifestEntry


def bucket_region(manifest: Manifest, holders: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The uint8 region that bucket ``manifest`` can be received into, or None.

    ``holders``: HF name -> the tensor a loader writes (a Parameter, buffer or shadow tensor). The region
    is returned only when every entry is a full tensor whose holder lies in one storage of exactly
    ``manifest.total_bytes`` bytes on ``device``, at the entry's offset, with its shape and dtype, and no
    other holder shares that storage.
    """
    entries = manifest.entries
    if not entries or any(e.encoding != FULL for e in entries):
        return None
    first = holders.get(entries[0].name)
    if first is None or first.device != device:
        return None
    storage = first.untyped_storage()
    if storage.nbytes() != manifest.total_bytes:
        return None
    base = storage.data_ptr()
    spans = set()
    for entry in entries:
        holder = holders.get(entry.name)
        if holder is None or not _fits(holder, entry, device) or holder.untyped_storage().data_ptr() != base:
            return None
        if _byte_offset(holder) != entry.offset:
            return None
        spans.add((entry.offset, entry.nbytes))
    for holder in holders.values():  # nothing else lives in the region (tied names share a span)
        if holder.device == device and holder.untyped_storage().data_ptr() == base:
            if (_byte_offset(holder), _nbytes(holder)) not in spans:
                return None
    flat = first.detach().reshape(-1).view(torch.uint8)
    return flat.as_strided((manifest.total_bytes,), (1,), 0)


def adoptable(manifest: Manifest, holders: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Whether full bucket ``manifest`` may become the layout of its tensors (:func:`adopt_region`).

    Not when an entry is not a full tensor matching its holder on ``device``, or names a tied tensor that
    was sent under its other name too (in this bucket, or placed by another bucket already: moving it back
    and forth would cost a region every sync).
    """
    entries = manifest.entries
    if not entries or any(e.encoding != FULL for e in entries):
        return False
    names_per_holder: dict[int, int] = {}
    for tensor in holders.values():
        names_per_holder[id(tensor)] = names_per_holder.get(id(tensor), 0) + 1
    seen: set[int] = set()
    for entry in entries:
        found = holders.get(entry.name)
        if found is None or not _fits(found, entry, device) or id(found) in seen:
            return False
        if names_per_holder[id(found)] > 1 and found.untyped_storage().nbytes() != _nbytes(found):
            return False
        seen.add(id(found))
    return True


def adopt_region(manifest: Manifest, holders: dict[str, torch.Tensor], region: torch.Tensor) -> None:
    """Make the tensors of bucket ``manifest`` views of ``region`` (a uint8 buffer of ``total_bytes`` that
    already holds their new bytes at the manifest's offsets): no copy. Call only when :func:`adoptable`
    said so, holding the model (nothing may read these tensors meanwhile)."""
    assert region.numel() == manifest.total_bytes and region.dtype == torch.uint8
    for entry in manifest.entries:
        holder = holders[entry.name]
        holder.data = region[entry.offset : entry.offset + entry.nbytes].view(holder.dtype).view(holder.shape)


def _fits(holder: torch.Tensor, entry: ManifestEntry, device: torch.device) -> bool:
    try:
        dtype = dtype_from_name(entry.dtype)
    except ValueError:
        return False
    return (holder.device == device and holder.dtype == dtype and list(holder.shape) == list(entry.shape)
            and holder.is_contiguous() and _nbytes(holder) == entry.nbytes)


def _byte_offset(tensor: torch.Tensor) -> int:
    return int(tensor.storage_offset()) * tensor.element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
