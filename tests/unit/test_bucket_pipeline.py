"""The sender's bucket pipeline: a tensor that fills a bucket alone goes on the wire from its own memory with
the manifest a packed bucket would carry; buckets are announced as soon as they are packed, in send order."""

from __future__ import annotations

import threading

import torch

from raygym.weightsync.codec import checksum, dtype_name, tensor_bytes
from raygym.weightsync.payload import FULL, Manifest, encode_tensor, pack_bucket
from raygym.weightsync.pipeline import BucketPipeline


class Wire:
    """Records what the pipeline announces and sends; ``hold`` keeps the first send until released."""

    def __init__(self, hold: bool = False):
        self.announced: list[torch.Tensor] = []
        self.sent: list[tuple[bytes, torch.Tensor]] = []  # (manifest, a copy of the flat buffer)
        self.sent_from: list[int] = []  # where each flat buffer lay in memory
        self.release = threading.Event()
        self.two_announced = threading.Event()
        if not hold:
            self.release.set()

    def announce(self, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        self.announced.append(flat)
        if len(self.announced) == 2:
            self.two_announced.set()

    def send(self, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        assert self.release.wait(30)
        self.sent.append((bytes(manifest.numpy()), flat.clone()))
        self.sent_from.append(flat.data_ptr())


def write_packed(pipe: BucketPipeline, name: str, tensor: torch.Tensor) -> None:
    raw = tensor_bytes(tensor)
    pipe.reserve(raw.numel(), itemsize=tensor.element_size()).copy_(raw)
    pipe.add(name, tuple(tensor.shape), dtype_name(tensor.dtype), FULL, raw.numel(), checksum(tensor))


def test_a_tensor_that_fills_a_bucket_is_sent_from_its_own_memory():
    pipe = BucketPipeline(max_bytes=1024)
    wire = Wire()
    small = torch.arange(8, dtype=torch.float32)
    big = torch.randn(16, 32)  # 2048 bytes: more than a bucket, a multiple of the alignment
    assert pipe.sends_alone(big.numel() * 4) and pipe.sends_alone(512)  # half a bucket or more ...
    assert not pipe.sends_alone(448) and not pipe.sends_alone(1000)  # ... less, or not a multiple of 64 bytes
    pipe.start(wire.send, version=3, announce=wire.announce)
    write_packed(pipe, "norm.weight", small)
    pipe.send_alone("embed.weight", tuple(big.shape), "float32", checksum(big), tensor_bytes(big))
    pipe.finish()

    assert [len(Manifest.from_bytes(m).entries) for m, _ in wire.sent] == [1, 1] and pipe.buckets == 2
    manifest, flat = wire.sent[1]
    assert wire.sent_from[1] == big.data_ptr()  # no copy: the tensor's own bytes went on the wire
    want_manifest, want_flat = pack_bucket([encode_tensor("embed.weight", big)], version=3)
    assert manifest == bytes(want_manifest.numpy()) and torch.equal(flat, want_flat)
    small_manifest, small_flat = pack_bucket([encode_tensor("norm.weight", small)], version=3)
    assert wire.sent[0][0] == bytes(small_manifest.numpy()) and torch.equal(wire.sent[0][1], small_flat)
    assert [f.data_ptr() for f in wire.announced] == wire.sent_from  # announced as sent, in order
    assert pipe.sent_bytes == sum(len(m) + f.numel() for m, f in wire.sent)


def test_buckets_are_announced_once_packed_while_an_earlier_one_is_still_on_the_wire():
    pipe = BucketPipeline(max_bytes=256)
    wire = Wire(hold=True)  # bucket 0 stays on the wire until released
    seen: dict[str, int] = {}

    def release_once_two_are_announced() -> None:
        assert wire.two_announced.wait(30)
        seen["sent"] = len(wire.sent)
        wire.release.set()

    watcher = threading.Thread(target=release_once_two_are_announced)
    watcher.start()
    pipe.start(wire.send, version=1, announce=wire.announce)
    for i in range(3):
        write_packed(pipe, f"w{i}", torch.full((60,), float(i)))  # 240 bytes: a bucket each
    pipe.finish()
    watcher.join()
    assert seen == {"sent": 0}  # bucket 1 was announced while bucket 0 was still held on the wire
    assert [Manifest.from_bytes(m).entries[0].name for m, _ in wire.sent] == ["w0", "w1", "w2"]
    assert [f.data_ptr() for f in wire.announced] == wire.sent_from
