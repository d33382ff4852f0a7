"""KV caches for raygym's server: transformers' ``DynamicCache`` with layers that grow in place, and the
helpers continuous batching needs to merge caches of requests that joined a running batch."""

from __future__ import annotations

import functools
from typing import Any

import torch

_MERGEABLE_LAYERS = ("DynamicLayer", "GrowingKVLayer")


def _mergeable(cache: Any) -> bool:
    """Only plain full-attention cache layers can be padded and stacked (not sliding/linear ones)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(
        type(layer).__name__ in _MERGEABLE_LAYERS and layer.is_initialized for layer in layers
    )


@functools.cache
def _growing_layer_class() -> type:
    """``transformers``' ``DynamicLayer`` with amortised growth (built on first use: transformers loads lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingKVLayer(DynamicLayer):
        """Keys/values are views into a buffer with room to grow, so a decode step writes its token in
        place instead of concatenating the whole cache (``DynamicLayer``: O(length) copy per step, 13% of a
        CPU decode of 128 x 16 tokens). Anything that replaces ``keys`` (batch selection, the continuous-
        batching merge, a crop) leaves the buffer behind, and the next update starts a new one."""

        _buf_k: torch.Tensor | None = None
        _buf_v: torch.Tensor | None = None

        def _in_buffer(self, add: torch.Tensor) -> bool:
            buf, keys = self._buf_k, self.keys
            assert keys is not None  # initialised by the first update
            return (
                buf is not None and keys.numel() > 0 and keys.data_ptr() == buf.data_ptr()
                and keys.stride() == buf.stride() and keys.shape[:-2] == add.shape[:-2]
                and keys.shape[-2] + add.shape[-2] <= buf.shape[-2]
            )

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            assert self.keys is not None and self.values is not None
            n = self.keys.shape[-2] if self.keys.numel() else 0
            end = n + key_states.shape[-2]
            if not self._in_buffer(key_states):
                shape = (*key_states.shape[:-2], end + max(32, end), key_states.shape[-1])  # x2 headroom
                self._buf_k, self._buf_v = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    self._buf_k[..., :n, :] = self.keys
                    self._buf_v[..., :n, :] = self.values
            assert self._buf_k is not None and self._buf_v is not None
            self._buf_k[..., n:end, :] = key_states
            self._buf_v[..., n:end, :] = value_states
            self.keys, self.values = self._buf_k[..., :end, :], self._buf_v[..., :end, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the rows ``indices`` (finished rows leave the batch) inside the same buffer: only the rows
            whose place changes are copied, and the headroom stays. With :func:`fill_order`'s indices that is
            one row per finished row (``DynamicLayer`` copies every kept row out, and its next update copies
            them all once more into a new buffer)."""
            if self.keys is None or not self.keys.numel():
                return
            if self._buf_k is None or self.keys.data_ptr() != self._buf_k.data_ptr():
                super().batch_select_indices(indices)
                return
            assert self._buf_v is not None
            n, m = self.keys.shape[-2], int(indices.numel())
            place = torch.arange(m, device=indices.device)
            moved = indices != place
            if bool(moved.any()):
                src, dst = indices[moved], place[moved]
                self._buf_k[dst, ..., :n, :] = self._buf_k[src, ..., :n, :]
                self._buf_v[dst, ..., :n, :] = self._buf_v[src, ..., :n, :]
            self._buf_k, self._buf_v = self._buf_k[:m], self._buf_v[:m]
            self.keys, self.values = self._buf_k[..., :n, :], self._buf_v[..., :n, :]

    return GrowingKVLayer


def fill_order(keep: list[int]) -> list[int]:
    """The rows of a batch after the rows not in ``keep`` (ascending) leave it: row ``p`` of the smaller batch
    is row ``order[p]`` of the old one. Kept rows stay where they are and each hole below the new size takes a
    kept row from beyond it, so compacting a KV cache moves one row per row that left, not every row after it.

    >>> fill_order([0, 2, 3, 5]), fill_order([1, 2]), fill_order([0, 1])
    ([0, 5, 2, 3], [2, 1], [0, 1])
    """
    size = len(keep)
    kept = set(keep)
    beyond = iter(i for i in keep if i >= size)
    return [p if p in kept else next(beyond) for p in range(size)]


def new_kv_cache() -> Any:
    """A ``DynamicCache`` whose layers grow in place (see ``GrowingKVLayer``); same results, faster decode.

    >>> cache = new_kv_cache()  # doctest: +SKIP
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    if hasattr(cache, "layer_class_to_replicate"):  # transformers' layered caches (5.x); else plain growth
        cache.layer_class_to_replicate = _growing_layer_class()
    return cache


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad ``t`` on the left of ``dim`` up to ``width`` (KV: [B, H, S, D] -> dim 2)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
