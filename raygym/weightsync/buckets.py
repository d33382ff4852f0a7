"""Group a stream of tensors into buckets of at most ``max_bytes`` (pure: no torch, no Ray).

Order is preserved; a tensor larger than a bucket travels alone in its own bucket.

>>> metas = [TensorMeta("a", (4,), "float32", 16), TensorMeta("b", (8,), "float32", 32),
...          TensorMeta("c", (2,), "float32", 8)]
>>> [[m.name for m in b.metas] for b in plan_buckets(metas, max_bytes=40)]
[['a'], ['b', 'c']]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from raygym.errors import ConfigError


class TensorMeta(NamedTuple):
    """What the planner needs to know about one tensor: its name, shape, dtype name and size in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass
class Bucket:
    """Consecutive tensors that travel together; ``nbytes`` is the sum of their sizes."""

    metas: list[TensorMeta] = field(default_factory=list)
    nbytes: int = 0


class BucketPlanner:
    """Streaming form of :func:`plan_buckets`: ``add`` returns a bucket whenever one is full.

    >>> p = BucketPlanner(max_bytes=10)
    >>> p.add(TensorMeta("a", (6,), "uint8", 6)), [m.name for m in p.add(TensorMeta("b", (6,), "uint8", 6)).metas]
    (None, ['a'])
    >>> [m.name for m in p.finish().metas]
    ['b']
    """

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise ConfigError(
                f"update_weight_buffer_size={max_bytes!r}: must be a positive number of bytes; "
                "set --update-weight-buffer-size 536870912 (512 MiB) or smaller on CPU (e.g. 16777216)"
            )
        self.max_bytes = max_bytes
        self._current = Bucket()

    def add(self, meta: TensorMeta) -> Bucket | None:
        """Add one tensor; return the previous bucket if this tensor does not fit in it, else None."""
        if meta.nbytes < 0:
            raise ValueError(f"tensor {meta.name!r} has negative size {meta.nbytes}")
        full = None
        if self._current.metas and self._current.nbytes + meta.nbytes > self.max_bytes:
            full, self._current = self._current, Bucket()
        self._current.metas.append(meta)
        self._current.nbytes += meta.nbytes
        return full

    def finish(self) -> Bucket | None:
        """The last, partly filled bucket (None when nothing is left)."""
        last, self._current = self._current, Bucket()
        return last if last.metas else None


def iter_buckets(metas: Iterable[TensorMeta], max_bytes: int) -> Iterator[Bucket]:
    """Yield buckets as soon as they are complete (for streams that cannot be held at once)."""
    planner = BucketPlanner(max_bytes)
    for meta in metas:
        full = planner.add(TensorMeta(*meta))
        if full is not None:
            yield full
    last = planner.finish()
    if last is not None:
        yield last


def plan_buckets(
    metas: Iterable[TensorMeta | tuple[str, tuple[int, ...], str, int]], max_bytes: int
) -> list[Bucket]:
    """Split ``metas`` (name, shape, dtype, nbytes) into order-preserving buckets of <= ``max_bytes``.

    A tensor larger than ``max_bytes`` gets a bucket of its own.
    """
    return list(iter_buckets((TensorMeta(*m) for m in metas), max_bytes))
