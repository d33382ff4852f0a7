"""Encode bucket k+1 while bucket k is on the wire: a small double-buffered pipeline for the sender.

The caller thread writes entries straight into a :class:`~raygym.weightsync.payload.BucketBuffer`;
a full bucket goes to one send thread and the caller continues in the other buffer. torch copies,
numpy compares and xxh3 release the GIL, and so do gloo's waits, so both threads make progress.
Buffers are kept for the next push.

>>> pipe = BucketPipeline(max_bytes=32 << 20)                      # doctest: +SKIP
>>> pipe.start(lambda manifest, flat: transport.send_bucket(v, manifest, flat), version=v)  # doctest: +SKIP
>>> slot = pipe.reserve(n); ...; pipe.add(name, shape, dtype, "full", n, digest)           # doctest: +SKIP
>>> transfer_s, wait_s = pipe.finish()                                                    # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from raygym.weightsync.payload import ALIGN, FULL, BucketBuffer, Manifest, ManifestEntry, packed_size

SendFn = Callable[[torch.Tensor, torch.Tensor], None]


class BucketPipeline:
    """``depth`` reusable bucket buffers and one send thread (depth 2 = one bucket in flight)."""

    def __init__(self, max_bytes: int, depth: int = 2, align: int = ALIGN):
        self.max_bytes = max_bytes
        self.align = align
        self._buffers = [BucketBuffer(max_bytes, align) for _ in range(depth)]
        self._free: deque[BucketBuffer] = deque(self._buffers)
        self._inflight: deque[tuple[Future, BucketBuffer | None]] = deque()  # None: sent from its own memory
        self._pool: ThreadPoolExecutor | None = None
        self._send: SendFn | None = None
        self._announce: SendFn | None = None
        self._version = 0
        self._current: BucketBuffer | None = None
        self._covered = 0  # full bytes of the tensors in the current bucket
        self.buckets = 0
        self.sent_bytes = 0
        self.transfer_s = 0.0  # time the send thread spent sending
        self.wait_s = 0.0  # time the caller waited for a free buffer (the wire was the bottleneck)

    @property
    def grow_s(self) -> float:
        """Seconds its buffers spent growing so far (new memory: a one-time cost of the first pushes)."""
        return sum(buf.grow_s for buf in self._buffers)

    def start(self, send: SendFn, version: int, announce: SendFn | None = None) -> None:
        """Begin a push: ``send(manifest, flat)`` is called in order, one bucket at a time; ``announce(manifest,
        flat)`` (optional) as soon as a bucket is packed, before it waits its turn to be sent. Every announced
        bucket is sent, even when the push fails (the engines may already expect it)."""
        self._send, self._version, self._announce = send, version, announce
        self.buckets, self.sent_bytes, self.transfer_s, self.wait_s = 0, 0, 0.0, 0.0
        if self._pool is not None or self._inflight or self._current is not None:
            self.close()  # the last push was interrupted (e.g. KeyboardInterrupt) before it could clean up
        # every push takes the buffers in the same order, so bucket k lands in the buffer it did last time and
        # no buffer grows again once the first push is done
        self._free = deque(self._buffers)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raygym-send")
        self._current = self._take()
        self._covered = 0

    def reserve(self, nbytes: int, covers: int | None = None, itemsize: int = 1) -> torch.Tensor:
        """A uint8 slot for the next entry; hands the current bucket to the wire when it is full.

        ``covers``: the full size of the tensor a (delta) entry stands for. A bucket is also cut after
        ``max_bytes`` of covered weights, so small delta payloads still flow in several buckets and
        the engines apply and verify them while the next ones are encoded. ``itemsize``: the entry's
        element size (a compact bucket only takes an entry at an offset it divides).
        """
        assert self._current is not None, "start() first"
        covers = nbytes if covers is None else covers
        if not self._current.fits(nbytes, itemsize) or (self._current.entries and self._covered + covers > self.max_bytes):
            self._flush()
        self._covered += covers
        return self._current.reserve(nbytes)

    def add(self, name: str, shape: tuple[int, ...], dtype: str, encoding: str, nbytes: int, digest: str) -> None:
        """Record the entry written into the slot from :meth:`reserve`."""
        assert self._current is not None
        self._current.add(name, shape, dtype, encoding, nbytes, digest)

    def sends_alone(self, nbytes: int) -> bool:
        """Whether a full entry of ``nbytes`` is sent as a bucket of its own, from its own memory
        (:meth:`send_alone`): it fills at least half a bucket and needs no padding. Packing it would copy
        most of a bucket to save one bucket's request."""
        return 2 * nbytes >= self.max_bytes and packed_size(nbytes, self.align) == nbytes

    def send_alone(self, name: str, shape: tuple[int, ...], dtype: str, digest: str, data: torch.Tensor) -> None:
        """Send the contiguous uint8 CPU bytes ``data`` of one full entry as a bucket of its own, straight
        from its memory: the manifest and bytes on the wire are those of a packed bucket holding only this
        entry, without the copy into a bucket buffer (an embedding is the largest tensor of most models).
        ``data`` must stay unchanged until :meth:`finish` returns."""
        assert self._current is not None and self._pool is not None, "start() first"
        assert self.sends_alone(data.numel()) and data.dtype == torch.uint8 and data.is_contiguous()
        if self._current.entries:
            self._flush()
        manifest = Manifest(self._version, [ManifestEntry(name, list(shape), dtype, FULL, 0, data.numel(), digest)],
                            data.numel()).to_bytes()
        manifest_tensor = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        self._submit(manifest_tensor, data, None)
        # no more buckets in flight than with buffers alone
        self._retire_until(lambda: len(self._inflight) < len(self._buffers))

    def finish(self) -> None:
        """Send the last bucket and wait for every send; raises the first send error."""
        try:
            if self._current is not None and self._current.entries:
                self._flush()
            while self._inflight:
                self._retire()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the send thread once every queued bucket was sent (used on errors too: a bucket that was
        announced may be awaited by the engines; after a failed send the rest fail at once)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        while self._inflight:
            _, buf = self._inflight.popleft()
            if buf is not None:
                buf.reset()
                self._free.append(buf)
        if self._current is not None:
            self._current.reset()
            self._free.append(self._current)
            self._current = None

    def _flush(self) -> None:
        buf = self._current
        assert buf is not None and self._pool is not None
        manifest, flat = buf.finish(self._version)
        self._submit(manifest, flat, buf)
        self._current = self._take()
        self._covered = 0

    def _submit(self, manifest: torch.Tensor, flat: torch.Tensor, buf: BucketBuffer | None) -> None:
        assert self._pool is not None
        if self._announce is not None:
            self._announce(manifest, flat)
        self.buckets += 1
        self.sent_bytes += int(manifest.numel() + flat.numel())
        self._inflight.append((self._pool.submit(self._timed_send, manifest, flat), buf))

    def _take(self) -> BucketBuffer:
        self._retire_until(lambda: bool(self._free))  # a bucket sent from its own memory frees no buffer
        return self._free.popleft()

    def _retire_until(self, done: Callable[[], bool]) -> None:
        """Wait for the oldest sends until ``done()``; the time counts as waiting for the wire."""
        if done():
            return
        start = time.perf_counter()
        while not done():
            self._retire()
        self.wait_s += time.perf_counter() - start

    def _retire(self) -> None:
        future, buf = self._inflight.popleft()
        try:
            self.transfer_s += future.result()
        finally:
            if buf is not None:
                buf.reset()
                self._free.append(buf)

    def _timed_send(self, manifest: torch.Tensor, flat: torch.Tensor) -> float:
        start = time.perf_counter()
        assert self._send is not None
        self._send(manifest, flat)
        return time.perf_counter() - start


class Lookahead:
    """``map`` over a stream in ``threads`` workers, at most ``depth`` items ahead, results in order.
    With 0 threads it runs inline (full pushes: nothing worth a thread).

    >>> la = Lookahead(threads=2, depth=4)
    >>> list(la.map(lambda x: x * x, range(5))); la.close()
    [0, 1, 4, 9, 16]
    """

    def __init__(self, threads: int, depth: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="raygym-enc") if threads else None
        self.depth = depth

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        if self._pool is None:
            yield from map(fn, items)
            return
        queue: deque[Future] = deque()
        for item in items:
            queue.append(self._pool.submit(fn, item))
            if len(queue) > self.depth:
                yield queue.popleft().result()
        while queue:
            yield queue.popleft().result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
