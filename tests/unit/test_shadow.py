"""Double-buffered receive on the engine side: updates land in a shadow copy the model never reads, the
switch swaps it in at once (tied weights stay tied), the next update starts from the served weights, and a
discarded update leaves the served weights as they were."""

from __future__ import annotations

import contextlib

import pytest
import torch

from raygym.engines.serving.weight_receiver import WeightReceiver, WeightRequestError, copy_by_name
from raygym.weightsync.codec import checksum
from raygym.weightsync.loader import load_payload
from raygym.weightsync.payload import BUCKET_NAME, MANIFEST_NAME, encode_tensor, pack_bucket

IDS = torch.tensor([[3, 7, 11, 5, 2]])


@pytest.fixture()
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def next_version(model, scale: float) -> dict[str, torch.Tensor]:
    return {n: t.detach() * scale + 0.01 for n, t in model.state_dict().items()}


def test_shadow_update_is_invisible_until_the_switch(model):
    receiver = WeightReceiver(model, weight_version="6")
    served = receiver.weights_checksum()["checksums"]
    before = logits(model)
    new = next_version(model, 1.5)
    assert receiver.shadow_begin()["success"]
    answer = receiver.load(new.items(), copy_by_name, "7")
    assert answer["success"], answer
    # still serving version 6, bit for bit
    assert receiver.weight_version == "6"
    assert receiver.weights_checksum()["checksums"] == served
    assert torch.equal(logits(model), before)
    shadow = receiver.weights_checksum(shadow=True)
    assert shadow["weight_version"] == "7"
    assert shadow["checksums"] == {n: checksum(t) for n, t in new.items()}

    held = []

    @contextlib.contextmanager
    def hold():
        held.append("in")
        yield
        held.append("out")

    switched = receiver.shadow_switch(hold=hold)
    assert switched["success"] and switched["weight_version"] == "7" and held == ["in", "out"]
    assert receiver.weights_checksum()["checksums"] == {n: checksum(t) for n, t in new.items()}
    assert not torch.equal(logits(model), before)


def test_tied_weights_stay_tied_across_switches():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).eval()
    receiver = WeightReceiver(model)
    for version, scale in (("1", 2.0), ("2", 0.5)):
        new = next_version(model, scale)
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
        receiver.shadow_begin()
        assert receiver.load(new.items(), copy_by_name, version)["success"]
        receiver.shadow_switch()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, new["model.embed_tokens.weight"])


def test_the_next_update_starts_from_the_served_weights(model):
    """After a switch the shadow holds the previous version; a delta loaded into it must apply on top of
    the served weights (the shadow is brought up to date at the next begin)."""
    receiver = WeightReceiver(model, weight_version="1")
    v2 = next_version(model, 2.0)
    receiver.shadow_begin()
    assert receiver.load(v2.items(), copy_by_name, "2")["success"]
    receiver.shadow_switch()
    name = "model.norm.weight"
    v3 = {n: t.clone() for n, t in v2.items()}
    v3[name][::2] += 1.0
    manifest, flat = pack_bucket([encode_tensor(name, v3[name], v2[name], "indices")], version=3)
    assert receiver.shadow_begin()["success"]
    answer = receiver.load([(MANIFEST_NAME, manifest), (BUCKET_NAME, flat)], load_payload, "3")
    assert answer["success"], answer
    assert receiver.shadow_switch()["weight_version"] == "3"
    assert receiver.weights_checksum()["checksums"] == {n: checksum(t) for n, t in v3.items()}


def test_a_discarded_or_failed_shadow_update_leaves_the_served_weights(model):
    receiver = WeightReceiver(model, weight_version="4")
    served = receiver.weights_checksum()["checksums"]
    receiver.shadow_begin()
    bad = {"model.norm.weight": torch.zeros(3)}  # wrong shape: refused, nothing written anywhere
    assert not receiver.load(bad.items(), copy_by_name, "5")["success"]
    assert receiver.load(next_version(model, 3.0).items(), copy_by_name, "5")["success"]
    assert receiver.shadow_discard()["success"]
    assert receiver.weights_checksum()["checksums"] == served and receiver.weight_version == "4"
    assert not receiver.shadow_switch()["success"]  # nothing open
    with pytest.raises(WeightRequestError, match="shadow"):
        receiver.weights_checksum(shadow=True)
    # without a shadow update, loads write the served weights directly (and move the label)
    assert receiver.load(next_version(model, 0.5).items(), copy_by_name, "6")["success"]
    assert receiver.weight_version == "6" and receiver.weights_checksum()["checksums"] != served


def test_a_full_update_skips_the_copy_only_when_that_is_exact(model):
    """begin(full=True): every sent tensor is rewritten, unsent ones are equal in both copies. After the
    served weights were written directly, that no longer holds and the copy is made anyway."""
    receiver = WeightReceiver(model, weight_version="0")
    v1 = next_version(model, 2.0)
    receiver.shadow_begin(full=True)
    assert receiver.load(v1.items(), copy_by_name, "1")["success"]
    receiver.shadow_switch()
    norm = {"model.norm.weight": torch.full_like(v1["model.norm.weight"], 3.0)}
    assert receiver.load(norm.items(), copy_by_name, "2")["success"]  # written directly, not double-buffered
    rest = {n: t * 0.5 for n, t in next_version(model, 1.0).items() if n != "model.norm.weight"}
    receiver.shadow_begin(full=True)
    assert receiver.load(rest.items(), copy_by_name, "3")["success"]
    receiver.shadow_switch()
    want = {**{n: checksum(t) for n, t in rest.items()}, "model.norm.weight": checksum(norm["model.norm.weight"])}
    assert receiver.weights_checksum()["checksums"] == want
    # and when nothing was written directly, a full update of every tensor is exact without the copy
    v4 = next_version(model, 0.25)
    assert receiver.shadow_begin(full=True)["success"]
    assert receiver.load(v4.items(), copy_by_name, "4")["success"]
    receiver.shadow_switch()
    assert receiver.weights_checksum()["checksums"] == {n: checksum(t) for n, t in v4.items()}


def test_a_shadow_is_written_directly_and_verified_by_its_checksums(model):
    """Into a shadow, load_payload writes without staging or hashing; a corrupted payload is caught by the
    shadow's checksums (what the coordinator compares before any switch) and never reaches the served model."""
    receiver = WeightReceiver(model, weight_version="1")
    served = receiver.weights_checksum()["checksums"]
    name = "model.norm.weight"
    new = model.state_dict()[name] * 2.0
    manifest, flat = pack_bucket([encode_tensor(name, new)], version=2)
    flat[0] ^= 0x01  # one flipped bit on the wire
    receiver.shadow_begin()
    assert receiver.load([(MANIFEST_NAME, manifest), (BUCKET_NAME, flat)], load_payload, "2")["success"]
    assert receiver.weights_checksum(shadow=True)["checksums"][name] != checksum(new)  # the coordinator's check
    receiver.shadow_discard()
    assert receiver.weights_checksum()["checksums"] == served
    # the served model keeps the all-or-nothing check: the same bucket is refused there
    assert not receiver.load([(MANIFEST_NAME, manifest), (BUCKET_NAME, flat)], load_payload, "2")["success"]
    assert receiver.weights_checksum()["checksums"] == served
