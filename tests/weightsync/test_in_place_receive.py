"""Full syncs over a real gloo group into two raygym servers: the first full bucket lands in a fresh region
that becomes its tensors' storage, the next ones of that layout land straight in the weights (served, or the shadow copy when double-buffered), every
sync still verified tensor by tensor against the trainer, and the servers still generate the trainer's
tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch

from raygym.config import Recipe
from raygym.engines.serving.weight_receiver import INCOMPLETE, WeightReceiver
from raygym.weightsync.codec import checksum
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.payload import BUCKET_NAME, LOADER, MANIFEST_NAME, encode_tensor, pack_bucket
from raygym.weightsync.pipeline import BucketPipeline
from raygym.weightsync.transport_dist import free_port
from tests.weightsync.local_trainer import LocalTrainer
from tests.weightsync.raygym_servers import raygym_servers


def recipe(**over) -> Recipe:
    fields = dict(update_weight_transport="nccl", update_weight_mode="full", update_weight_buffer_size=64 * 1024,
                  update_weight_timeout=30.0, update_weight_full_interval=0, update_weight_pause_mode="abort",
                  colocate=False)
    fields.update(over)
    return Recipe(**fields)


def engine_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def servers(tiny_model_path):
    """Two fresh raygym servers (float32; no layout adopted yet), ended by their own handles."""
    with raygym_servers(tiny_model_path, 2, "float32") as urls:
        yield urls


@pytest.mark.parametrize(("double_buffer", "buffer_size"), [(False, 64 * 1024), (True, 64 * 1024), (False, 16 * 1024)],
                         ids=["paused", "double_buffered", "tensor_sized_buckets"])
def test_full_syncs_land_in_place_once_the_layout_is_adopted(servers, tiny_model_path, double_buffer, buffer_size):
    """Tensors of half a bucket or more (the MLP matrices of 32 KiB in 64 KiB buckets; with 16 KiB buckets the
    attention matrices and the embedding too) are sent from the trainer's own memory, without packing: the
    engines cannot tell the difference."""
    trainer = LocalTrainer(tiny_model_path, lr=1e-3)
    sync = WeightSync(recipe(update_weight_double_buffer=double_buffer, update_weight_buffer_size=buffer_size),
                      [trainer], servers,
                      spec_overrides={"master_address": "127.0.0.1", "backend": "gloo"})
    sync.setup()
    history = []
    setups = []  # one-time seconds (new memory: the sender's snapshot and buffers, the engines' regions)
    try:
        for version in (1, 2, 3, 4):
            trainer.train_step()
            metrics = sync.push(version)
            assert metrics["sync/mode"] == 0.0 and metrics["sync/full_resyncs"] == 0.0
            assert metrics["sync/verified_tensors"] > 0  # the coordinator compared every tensor's checksum
            want = {n: checksum(t) for n, t in trainer.hf_weights()}
            for url in servers:
                answer = httpx.post(f"{url}/raygym/weights_checksum", json={"names": None}, timeout=30).json()
                assert answer["weight_version"] == str(version) and answer["checksums"] == want
            history.append((int(metrics["sync/adopted_buckets"]), int(metrics["sync/in_place_buckets"]),
                            int(metrics["sync/buckets"])))
            setups.append(metrics["sync/setup_s"])
        ids = [[5, 9, 13, 2, 7, 11]]
        with torch.no_grad():
            want_ids = trainer.model.generate(torch.tensor(ids), max_new_tokens=6, do_sample=False)[0, 6:].tolist()
        for url in servers:  # the re-homed parameters still make the trainer's model
            out = httpx.post(f"{url}/generate", json={"input_ids": ids[0], "sampling_params": {
                "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}, timeout=60).json()
            assert out["output_ids"] == want_ids
    finally:
        sync.shutdown()
    assert history[0][2] > 2, history
    # the first full sync lands in fresh regions that become the weights (double-buffered: each of the two
    # copies adopts the layout once); later ones land in those regions, every bucket but at most one holding
    # a tied tensor sent under its second name. A tensor of half a bucket or more is a bucket of its own, and
    # needs no region: its own storage has the bucket's layout, so it lands in place from the first sync on.
    adopting = 2 if double_buffer else 1
    travels_alone = BucketPipeline(buffer_size).sends_alone  # the sender's own rule
    lone = sum(travels_alone(t.numel() * t.element_size()) for _, t in trainer.hf_weights())
    assert lone > 0, "every bucket size here has tensors that travel alone"
    for adopted, in_place, buckets in history[:adopting]:
        assert buckets - 1 <= adopted + in_place <= buckets and adopted > 0 and in_place == lone, history
    for adopted, in_place, buckets in history[adopting:]:
        assert adopted == 0 and buckets - 1 <= in_place <= buckets, history
    assert setups[0] > 0.0 and setups[adopting:] == [0.0] * (4 - adopting), setups  # the seed's alone


SENDER = """
import sys, torch
from transformers import AutoModelForCausalLM
from tests.weightsync.test_in_place_receive import failing_bucket
from raygym.weightsync.transport_dist import broadcast, join_group
path, port, group = sys.argv[1:4]
manifest, flat = failing_bucket(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
pg = join_group("127.0.0.1", int(port), 0, 2, group, "gloo", 60.0)
corrupt = flat.clone()
corrupt[0] ^= 1  # one flipped bit on the wire
for buffer in (corrupt, flat):
    broadcast(pg, manifest, 60.0)
    broadcast(pg, buffer, 60.0)
broadcast(pg, manifest, 60.0)  # the third bucket's manifest ... and the sender dies before its buffer
sys.stdin.read()
"""


def failing_bucket(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    state = model.state_dict()
    names = ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"]
    return pack_bucket([encode_tensor(n, state[n] * 2.0) for n in names], version=1)


def test_a_bad_first_bucket_changes_nothing_and_a_broken_in_place_one_labels_the_weights_incomplete(tiny_model_path):
    model = engine_model(tiny_model_path)
    receiver = WeightReceiver(model, weight_version="0", timeout_s=60.0)
    group, port = "raygym_ws_in_place_test", free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, tiny_model_path, str(port), group], env=env,
                              stdin=subprocess.PIPE)
    try:
        joined = receiver.init_weights_update_group(master_address="127.0.0.1", master_port=port, rank_offset=1,
                                                    world_size=2, group_name=group, backend="gloo")
        assert joined["success"], joined
        receiver.timeout_s = 3.0  # each receive-side broadcast from now on (the sender starts slowly)
        manifest, flat = failing_bucket(model)
        body = {"names": [MANIFEST_NAME, BUCKET_NAME], "dtypes": ["uint8", "uint8"],
                "shapes": [[manifest.numel()], [flat.numel()]], "group_name": group, "load_format": LOADER}
        before = receiver.weights_checksum()["checksums"]
        corrupt = receiver.submit_distributed(**body, weight_version="1").result(timeout=60)
        assert corrupt["success"] is False and "checksum mismatch" in corrupt["message"], corrupt
        assert receiver.weights_checksum() == {"weight_version": "0", "checksums": before}  # all or nothing
        assert receiver.adopted_buckets == 0
        first = receiver.submit_distributed(**body, weight_version="1").result(timeout=60)
        assert first["success"] and receiver.adopted_buckets == 1, first  # a fresh region, then the layout
        assert first["setup_s"] >= first["apply_s"] > 0.0, first  # one-time: allocated, checked, adopted
        second = receiver.submit_distributed(**body, weight_version="2").result(timeout=60)
        assert receiver.in_place_buckets == 0
        assert second["success"] is False and INCOMPLETE in second["message"], second
        assert receiver.model_info()["weight_version"] == INCOMPLETE  # never again the label of intact weights
    finally:
        receiver.close()
        assert sender.stdin is not None
        sender.stdin.close()
        sender.wait(timeout=30)
