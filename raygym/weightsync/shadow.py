"""Double-buffered weights for an engine: the next version lands in a shadow copy while the model serves.

A sync that is double-buffered (``update_weight_double_buffer``) runs ``begin`` -> loads into
:meth:`ShadowWeights.target` (which looks like the model to every loader that writes by HF name) ->
verification of the shadow -> :meth:`ShadowWeights.switch`. Generation never reads the shadow, so it
keeps going during the whole transfer; the switch exchanges the storage behind every parameter and
buffer (no copy), between two forward passes, so every forward pass sees one complete version.

After a switch the shadow holds the previous version; the next ``begin`` brings it up to date by
copying the served weights (the copy runs while the engine serves; a delta is applied on top of it).
``begin(full=True)`` announces an update that rewrites every tensor it sends: only tensors that are
never sent are left, and those are the same in both copies, so nothing is copied.

>>> import torch
>>> model = torch.nn.Linear(2, 2, bias=False)
>>> shadow = ShadowWeights(model)
>>> _ = shadow.begin()
>>> _ = shadow.target().state_dict()["weight"].fill_(7.0)     # the next version, written by a loader
>>> float(model.weight.sum()) == 7.0 * 4                      # still serving the old one
False
>>> shadow.switch(); float(model.weight.sum())
28.0
"""

from __future__ import annotations

import time

import torch

from raygym.weightsync.codec import copy_bytes


class ShadowTarget(torch.nn.Module):
    """What a loader sees during a double-buffered update: the shadow tensors under the model's HF names.
    Nothing reads them until they are verified and switched in, so loaders may write them directly
    (:func:`raygym.weightsync.loader.load_payload` skips its own staging and checksums for them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self._named = tensors

    def state_dict(self, *args, **kwargs):  # loaders address tensors by HF name through the state dict
        return dict(self._named)


class ShadowWeights:
    """A second copy of ``model``'s state-dict tensors (parameters and persistent buffers).

    ``open``: a double-buffered update is in progress (loads go to the shadow); ``fresh``: the shadow holds
    exactly the served weights (no copy needed at the next ``begin``).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._holders: dict[str, torch.Tensor] = {}  # HF name -> the model's Parameter / buffer object
        self._shadow: dict[int, torch.Tensor] = {}  # id(holder) -> shadow storage
        self.open = False
        self.fresh = False
        self._served_written = False  # the served weights were written directly since the last full copy

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shadow.values())

    def begin(self, full: bool = False) -> float:
        """Start an update: allocate the shadow (first time) and bring it up to the served weights, unless
        ``full`` (every sent tensor is rewritten; see the module docstring); returns the seconds spent copying."""
        start = time.perf_counter()
        if not self._matches_model():
            self._allocate()
        elif full and not self._served_written:
            self.fresh = True  # unsent tensors match; sent ones are about to be overwritten
        if not self.fresh:
            with torch.no_grad():
                for holder in self._unique_holders():
                    copy_bytes(self._shadow[id(holder)], holder.data)
            self.fresh = True
            self._served_written = False
        self.open = True
        return time.perf_counter() - start

    def target(self) -> torch.nn.Module:
        """The shadow as a module whose ``state_dict()`` maps every HF name to its shadow tensor."""
        assert self.open, "begin() first"
        return ShadowTarget({name: self._shadow[id(holder)] for name, holder in self._holders.items()})

    def written(self) -> None:
        """A loader wrote into the shadow: it now differs from the served weights."""
        self.fresh = False

    def switch(self) -> None:
        """Serve the shadow: exchange the storage behind every parameter and buffer. The caller holds the
        model (between two forward passes). The old weights become the shadow, one version behind."""
        assert self.open, "begin() first"
        with torch.no_grad():
            for holder in self._unique_holders():
                served = holder.data
                holder.data = self._shadow[id(holder)]
                self._shadow[id(holder)] = served
        self.open = False
        self.fresh = False

    def discard(self) -> None:
        """Abandon the update in progress (the served weights are untouched)."""
        self.open = False
        self.fresh = False

    def served_changed(self) -> None:
        """The served weights were written directly (an update that was not double-buffered)."""
        self.fresh = False
        self._served_written = True

    def _unique_holders(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for holder in self._holders.values():
            seen.setdefault(id(holder), holder)  # tied weights share one parameter
        return list(seen.values())

    def _matches_model(self) -> bool:
        holders = self.model.state_dict(keep_vars=True)
        if set(holders) != set(self._holders) or any(holders[n] is not h for n, h in self._holders.items()):
            return False
        for holder in self._unique_holders():
            shadow, data = self._shadow[id(holder)], holder.data
            if shadow.shape != data.shape or shadow.dtype != data.dtype or shadow.device != data.device:
                return False  # the model moved (memory release) or changed: allocate again
        return True

    def _allocate(self) -> None:
        self._holders = dict(self.model.state_dict(keep_vars=True))
        self._shadow = {id(h): torch.empty_like(h.data, memory_format=torch.contiguous_format)
                        for h in self._unique_holders()}
        self.fresh = False
        self._served_written = True  # nothing copied yet
