"""The single CPU snapshot of the bytes every engine holds, by HF name (for delta payloads).

Changes of a sync are *staged* while it runs and *committed* only after every engine acknowledged
and verified the new version, so the snapshot never runs ahead of any engine. Staged changes are kept
as delta payloads (small at RL learning rates), or as a full copy of a tensor when that is smaller.

>>> import torch
>>> snap = WeightSnapshot()
>>> snap.stage("w", torch.zeros(3))
>>> snap.commit(1); snap.version, snap.get("w").tolist()
(1, [0.0, 0.0, 0.0])
>>> snap.stage("w", torch.tensor([0.0, 2.0, 0.0])); snap.get("w").tolist()  # not yet committed
[0.0, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from raygym.weightsync.codec import apply_delta, encode_delta


class WeightSnapshot:
    """CPU tensors by HF name; ``version`` is the last committed weight version (None before seeding)."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._staged: dict[str, tuple[str, bytes | torch.Tensor]] = {}
        self.version: int | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def get(self, name: str) -> torch.Tensor | None:
        """The committed tensor for ``name`` (None if unknown)."""
        return self._tensors.get(name)

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the snapshot with exactly these tensors (what the engines loaded), at ``version``."""
        self._tensors = {n: _cpu_copy(t) for n, t in named_tensors}
        self._staged.clear()
        self.version = version

    def stage(self, name: str, new: torch.Tensor, delta: bytes | torch.Tensor | None = None) -> None:
        """Record that engines will hold ``new`` under ``name`` once this sync is committed.

        ``delta`` may be the already encoded payload (new vs snapshot) to avoid encoding twice.
        """
        old = self._tensors.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            self._staged[name] = ("full", _cpu_copy(new))
            return
        if delta is None:
            delta = encode_delta(new, old, "indices")
            if len(delta) >= new.numel() * new.element_size():
                self._staged[name] = ("full", _cpu_copy(new))
                return
        self._staged[name] = ("delta", delta)

    def commit(self, version: int) -> None:
        """Apply every staged change: all engines now hold ``version``."""
        for name, (kind, data) in self._staged.items():
            if kind == "full":
                self._tensors[name] = data
            else:
                apply_delta(data, self._tensors[name])
        self._staged.clear()
        self.version = version

    def discard(self) -> None:
        """Drop staged changes (the sync failed; engines are resynced in full from the trainer)."""
        self._staged.clear()


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()
