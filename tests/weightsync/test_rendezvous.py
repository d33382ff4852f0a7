"""The weight-update rendezvous in both directions against a peer that is not raygym's code: a peer
written from SGLang's ``init_custom_process_group`` (tests/weightsync/rendezvous_peer.py; the same peer runs
SGLang's own function in tests/sglang_cpu). A peer without the group-name key prefix never meets either."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raygym.engine_api.protocol import UpdateWeightsFromDistributed
from raygym.engines.serving.weight_receiver import WeightReceiver, destroy_group
from raygym.weightsync.transport_dist import broadcast, free_port, host_store, join_group

PEER = str(Path(__file__).with_name("rendezvous_peer.py"))
EXPECTED = (torch.arange(8, dtype=torch.float32) * 0.5).tolist()


def start_peer(python: str, impl: str, role: str, port: int, rank: int, group: str, timeout: float = 60.0):
    return subprocess.Popen([python, PEER, "--impl", impl, "--role", role, "--port", str(port), "--rank", str(rank),
                             "--group", group, "--timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def peer_answer(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def raygym_sends_to(python: str, impl: str) -> None:
    store, port = host_store("127.0.0.1", 2, 120)  # as the sender does: a port the OS picks, no race for it
    peer = start_peer(python, impl, "recv", port, 1, "wug_a")
    pg = join_group("127.0.0.1", port, 0, 2, "wug_a", "gloo", 120, store=store)
    broadcast(pg, torch.arange(8, dtype=torch.float32) * 0.5, 120)
    assert peer_answer(peer) == {"received": EXPECTED}
    destroy_group(pg, "wug_a")


def raygym_receives_from(python: str, impl: str) -> None:
    port = free_port("127.0.0.1")
    peer = start_peer(python, impl, "send", port, 0, "wug_b")
    receiver = WeightReceiver(torch.nn.Linear(2, 2), timeout_s=120)
    # master_port as a string, as SGLang's own tests send it
    joined = receiver.init_weights_update_group(master_address="127.0.0.1", master_port=str(port), rank_offset=1,
                                                world_size=2, group_name="wug_b", backend="gloo")
    assert joined["success"], joined
    req = UpdateWeightsFromDistributed(names=["x"], dtypes=["float32"], shapes=[[8]], group_name="wug_b")
    ((name, tensor),) = receiver.receive_distributed(req)
    assert name == "x" and tensor.tolist() == EXPECTED
    assert peer_answer(peer) == {"sent": True}
    receiver.close()


def test_raygyms_sender_meets_a_receiver_written_from_sglangs_rendezvous():
    raygym_sends_to(sys.executable, "written")


def test_a_sender_written_from_sglangs_rendezvous_meets_raygyms_receiver():
    raygym_receives_from(sys.executable, "written")


def test_a_peer_without_the_group_prefix_never_meets_raygym():
    port = free_port("127.0.0.1")
    peer = start_peer(sys.executable, "unprefixed", "recv", port, 1, "wug_c", timeout=6)
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - gloo's own timeout error type varies by torch release
        pg = join_group("127.0.0.1", port, 0, 2, "wug_c", "gloo", 6)
        broadcast(pg, torch.zeros(8), 6)
    assert time.monotonic() - start < 60
    peer.communicate(timeout=120)
    assert peer.returncode != 0
