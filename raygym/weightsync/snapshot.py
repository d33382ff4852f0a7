"""The single CPU snapshot of the bytes every engine holds, by HF name (for delta payloads).

There is exactly one copy of the weights here, updated in place (host RAM is the limit at scale;
per-version copies are what blew it up elsewhere). A sync *stages* its changes and *commits* them
once every engine acknowledged and verified the new version:

- a sparse change (delta) is staged as its positions and raw values and scattered into the
  snapshot on :meth:`~WeightSnapshot.commit` — the snapshot never runs ahead of any engine;
- a dense change (a full tensor) is copied into the snapshot's own tensor right away, because
  holding a second full copy until the commit would double host memory. The snapshot is then
  *dirty*: :meth:`~WeightSnapshot.discard` makes it invalid (``version`` None), so the next push is
  full — which is what follows a failed sync anyway (the coordinator resyncs in full);
- a tensor the snapshot does not hold yet is copied and adopted on commit.

>>> import torch
>>> snap = WeightSnapshot()
>>> snap.stage("w", torch.zeros(1000))
>>> snap.commit(1); snap.version, float(snap.get("w").sum())
(1, 0.0)
>>> new = torch.zeros(1000); new[7] = 2.0
>>> snap.stage("w", new); float(snap.get("w").sum())  # sparse change: staged, not yet applied
0.0
>>> snap.commit(2); float(snap.get("w").sum())
2.0
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from raygym.weightsync.codec import (
    changed_positions_np,
    clone_cpu,
    copy_bytes,
    delta_nbytes,
    gather_values,
    int_view,
)


class WeightSnapshot:
    """CPU tensors by HF name; ``version`` is the last committed weight version (None = not usable)."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._sparse: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._new: dict[str, torch.Tensor] = {}
        self._dirty = False
        self.version: int | None = None
        self.alloc_s = 0.0  # seconds spent allocating (and first filling) tensors it did not hold yet

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def get(self, name: str) -> torch.Tensor | None:
        """The snapshot tensor for ``name`` (None if unknown). Only meaningful while ``version`` is set."""
        return self._tensors.get(name)

    def seed(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the snapshot with exactly these tensors (what the engines loaded), at ``version``."""
        self._tensors = {n: _cpu_copy(t) for n, t in named_tensors}
        self._clear_staged()
        self.version = version

    def stage(self, name: str, new: torch.Tensor, delta: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Record that engines will hold ``new`` under ``name`` once this sync is committed.

        ``delta`` may be the already found (positions, raw values) of ``new`` vs the snapshot, to
        avoid comparing twice. Without it the change is measured here and kept sparse when small.
        """
        old = self._tensors.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            self._adopt_copy(name, new)
            return
        if delta is None:
            positions = changed_positions_np(new, old)
            full = new.numel() * new.element_size()
            if delta_nbytes(positions.size, new.numel(), new.element_size(), "indices") >= full:
                self.overwrite(name, new)
                return
            delta = positions, gather_values(new, positions)
        self._sparse[name] = delta

    def overwrite(self, name: str, new: torch.Tensor) -> None:
        """Copy ``new`` into the snapshot's tensor now (dense change; see the module docstring)."""
        old = self._tensors.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            self._adopt_copy(name, new)
            return
        self._sparse.pop(name, None)
        self._dirty = True
        copy_bytes(old, new.detach().contiguous())

    def _adopt_copy(self, name: str, new: torch.Tensor) -> None:
        """A copy of a tensor the snapshot does not hold (or holds in another shape), adopted on commit;
        its time goes to ``alloc_s`` (new memory is first touched here: a one-time cost)."""
        start = time.perf_counter()
        self._new[name] = _cpu_copy(new)
        self.alloc_s += time.perf_counter() - start

    def commit(self, version: int) -> None:
        """Apply every staged change in place: all engines now hold ``version``."""
        for name, (positions, values) in self._sparse.items():
            view = int_view(self._tensors[name]).numpy()
            view[positions] = values
        self._tensors.update(self._new)
        self._clear_staged()
        self.version = version

    def discard(self) -> None:
        """Drop staged changes (the sync failed). If tensors were already overwritten the snapshot no
        longer matches any engine: it becomes invalid (``version`` None) until a full push commits."""
        if self._dirty:
            self.version = None
        self._clear_staged()

    def invalidate(self) -> None:
        """The engines will get weights this snapshot does not follow: unusable (``version`` None) until a
        push commits it again; its memory is kept for that."""
        self._clear_staged()
        self.version = None

    def _clear_staged(self) -> None:
        self._sparse.clear()
        self._new.clear()
        self._dirty = False


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return clone_cpu(t)
