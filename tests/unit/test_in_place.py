"""In-place receive layout (raygym.weightsync.in_place): a region is offered only when writing the whole
bucket buffer into it writes exactly the bucket's tensors, and adoption keeps every value."""

from __future__ import annotations

import torch

from raygym.weightsync.in_place import adopt_region, adoptable, bucket_region
from raygym.weightsync.payload import Manifest, encode_tensor, pack_bucket

CPU = torch.device("cpu")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 6)
        self.proj = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as LMs tie embeddings and head
        self.register_buffer("scale", torch.tensor([2.0]))


def adopt_layout(manifest: Manifest, holders: dict[str, torch.Tensor], device: torch.device) -> bool:
    """What the receiver does: the bucket lands in a fresh region, which becomes the tensors' storage."""
    if not adoptable(manifest, holders, device):
        return False
    region = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    for entry in manifest.entries:
        region[entry.offset : entry.offset + entry.nbytes].copy_(holders[entry.name].detach().reshape(-1).view(torch.uint8))
    adopt_region(manifest, holders, region)
    return True


def bucket_of(model: torch.nn.Module, names: list[str], version: int = 1) -> tuple[Manifest, torch.Tensor]:
    state = model.state_dict()
    manifest, flat = pack_bucket([encode_tensor(n, state[n]) for n in names], version)
    return Manifest.from_bytes(manifest), flat


def test_a_bucket_is_received_in_place_only_after_its_layout_was_adopted():
    model = Tiny()
    names = ["embed.weight", "proj.weight", "proj.bias", "scale"]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    manifest, _ = bucket_of(model, names)
    holders = model.state_dict(keep_vars=True)
    assert bucket_region(manifest, holders, CPU) is None
    assert adopt_layout(manifest, holders, CPU)
    after = model.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)  # the copy kept every value
    assert model.head.weight is model.embed.weight  # ties survive: one Parameter moved
    region = bucket_region(manifest, model.state_dict(keep_vars=True), CPU)
    assert region is not None and region.numel() == manifest.total_bytes


def test_receiving_into_the_region_updates_exactly_the_bucket_tensors():
    model, source = Tiny(), Tiny()
    with torch.no_grad():
        for t in source.parameters():
            t.add_(1.0)
        source.scale.fill_(3.0)
    names = ["embed.weight", "proj.bias", "scale"]
    manifest, _ = bucket_of(model, names)
    assert adopt_layout(manifest, model.state_dict(keep_vars=True), CPU)
    untouched = {n: t.clone() for n, t in model.state_dict().items() if n not in (*names, "head.weight")}
    region = bucket_region(manifest, model.state_dict(keep_vars=True), CPU)
    _, flat = bucket_of(source, names, version=2)
    region.copy_(flat)  # what the broadcast does
    state, want = model.state_dict(), source.state_dict()
    assert all(torch.equal(state[n], want[n]) for n in names)
    assert torch.equal(model.head.weight, source.embed.weight)
    assert all(torch.equal(state[n], t) for n, t in untouched.items())


def test_no_region_when_the_layout_differs_or_another_tensor_lives_there():
    model = Tiny()
    manifest, _ = bucket_of(model, ["proj.weight", "proj.bias"])
    assert adopt_layout(manifest, model.state_dict(keep_vars=True), CPU)
    holders = model.state_dict(keep_vars=True)
    reordered, _ = bucket_of(model, ["proj.bias", "proj.weight"])
    assert bucket_region(reordered, holders, CPU) is None  # same tensors, other offsets
    partial, _ = bucket_of(model, ["proj.weight"])
    assert bucket_region(partial, holders, CPU) is None  # the region holds proj.bias too
    assert bucket_region(manifest, holders, torch.device("meta")) is None  # another device


def test_delta_and_mismatched_buckets_are_never_in_place():
    model = Tiny()
    state = model.state_dict()
    old = state["proj.weight"].clone()
    new = old.clone()
    new[0, 0] += 1.0
    delta, _ = pack_bucket([encode_tensor("proj.weight", new, old, encoding="indices")], version=2)
    m = Manifest.from_bytes(delta)
    assert m.entries[0].encoding != "full"
    assert not adopt_layout(m, model.state_dict(keep_vars=True), CPU)
    assert bucket_region(m, model.state_dict(keep_vars=True), CPU) is None
    wrong, _ = pack_bucket([encode_tensor("proj.weight", new.to(torch.bfloat16))], version=2)
    assert not adopt_layout(Manifest.from_bytes(wrong), model.state_dict(keep_vars=True), CPU)  # dtype differs
    assert model.proj.weight.untyped_storage().nbytes() == old.numel() * 4  # nothing moved


def test_a_tensor_sent_under_two_tied_names_is_not_adopted():
    model = Tiny()
    manifest, _ = bucket_of(model, ["embed.weight", "head.weight"])
    assert not adopt_layout(manifest, model.state_dict(keep_vars=True), CPU)


def test_a_tied_tensor_sent_in_two_buckets_is_placed_once_and_not_moved_back_and_forth():
    model = Tiny()
    first, _ = bucket_of(model, ["embed.weight", "proj.bias"])
    second, _ = bucket_of(model, ["head.weight", "norm.weight"])
    assert adopt_layout(first, model.state_dict(keep_vars=True), CPU)
    assert not adopt_layout(second, model.state_dict(keep_vars=True), CPU)  # its head.weight is placed already
    assert bucket_region(first, model.state_dict(keep_vars=True), CPU) is not None
