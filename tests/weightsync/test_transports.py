"""Weight sync end to end on CPU: a real trainer (AdamW on the builtin tiny Qwen3) pushes to two raygym
servers (separate processes, real HTTP on 127.0.0.1) over gloo and over disk, full then delta, and the
engines must hold bit-identical weights after every step; failures must be named, never hang."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import torch

from raygym.config import Recipe
from raygym.engine_api.protocol import Endpoint
from raygym.engines.serving.weight_receiver import WeightReceiver
from raygym.errors import WeightSyncError
from raygym.weightsync.codec import checksum
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.engine_link import HttpEngineLink, LocalEngineLink
from raygym.weightsync.payload import LOADER
from raygym.weightsync.sender import RankWeightSync, SenderSpec
from raygym.weightsync.sources import WeightSources
from tests.weightsync.local_trainer import LocalTrainer
from tests.weightsync.raygym_servers import raygym_servers

pytestmark = pytest.mark.e2e

TIMEOUT_S = 30.0  # the sender's update_weight_timeout
SERVER_TIMEOUT_S = 8.0  # the servers' --weight-update-timeout: every receive-side broadcast is bounded by it
ENGINE_DTYPE = "bfloat16"  # trainer keeps fp32 master weights and casts for the engines (as in real runs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """Two raygym servers with raygym's loader registered, reading weights from this session's temp
    directories; ended by their own handles."""
    with raygym_servers(tiny_model_path, 2, ENGINE_DTYPE, ["--weight-update-timeout", str(SERVER_TIMEOUT_S),
                        "--weight-source", str(tmp_path_factory.getbasetemp()),
                        "--weight-source", "memory://raygym-sync"]) as urls:
        yield urls


def recipe(transport: str, **over) -> Recipe:
    fields = dict(update_weight_transport=transport, update_weight_mode="delta", update_weight_encoding="indices",
                  update_weight_buffer_size=64 * 1024, update_weight_timeout=TIMEOUT_S, update_weight_disk_dir="",
                  update_weight_full_interval=0, update_weight_pause_mode="abort", colocate=False)
    fields.update(over)
    return Recipe(**fields)


def engine_checksums(url: str) -> tuple[str, dict[str, str]]:
    answer = httpx.post(f"{url}/raygym/weights_checksum", json={"names": None}, timeout=30).json()
    return answer["weight_version"], answer["checksums"]


def run_steps(sync: WeightSync, trainer: LocalTrainer, urls: list[str], steps: int) -> list[dict[str, float]]:
    """First push (full), then ``steps`` x (AdamW step, push); engines checked bit-identical each time."""
    sync.setup()
    history = []
    for version in range(1, steps + 2):
        if version > 1:
            trainer.train_step()
        history.append(sync.push(version))
        want = trainer.engine_checksums()
        for url in urls:
            got_version, got = engine_checksums(url)
            assert got_version == str(version)
            assert {n: got[n] for n in want} == want, f"{url} differs from the trainer at version {version}"
    return history


def check_delta_history(history: list[dict[str, float]]) -> None:
    assert history[0]["sync/mode"] == 0.0  # first sync is full: seeds engines and snapshot identically
    for m in history[1:]:
        assert m["sync/mode"] == 1.0
        assert 0.0 < m["sync/changed_frac"] < 0.5  # bf16 rounding hides most updates at a small lr
        assert m["sync/bytes"] < history[0]["sync/bytes"]
        assert m["sync/full_resyncs"] == 0.0


def test_gloo_full_then_delta_bit_identical(servers, tiny_model_path):
    trainer = LocalTrainer(tiny_model_path)
    sync = WeightSync(recipe("nccl"), [trainer], servers,
                      spec_overrides={"cast_dtype": ENGINE_DTYPE,
                                      "master_address": "127.0.0.1"})
    try:
        history = run_steps(sync, trainer, servers, steps=3)
    finally:
        sync.shutdown()
    check_delta_history(history)


@pytest.mark.parametrize("encoding", ["deltas_zstd"])
def test_disk_local_dir_full_then_delta(servers, tiny_model_path, tmp_path, encoding):
    trainer = LocalTrainer(tiny_model_path)
    disk = tmp_path / "sync"
    sync = WeightSync(recipe("disk", update_weight_disk_dir=str(disk), update_weight_encoding=encoding),
                      [trainer], servers, spec_overrides={"cast_dtype": ENGINE_DTYPE})
    history = run_steps(sync, trainer, servers, steps=2)
    check_delta_history(history)
    assert list(disk.iterdir()) == []  # every version directory removed once all engines acknowledged


def test_disk_memory_url_with_in_process_engine(tiny_model_path):
    """memory:// is per process: the engine must live in the sender's process (separate servers cannot
    read it; they need a shared filesystem)."""
    from transformers import AutoModelForCausalLM

    trainer = LocalTrainer(tiny_model_path, lr=1e-3)
    engine_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    receiver = WeightReceiver(engine_model, sources=WeightSources(["memory://raygym-sync"]))
    sync = WeightSync(recipe("disk", update_weight_disk_dir="memory://raygym-sync", update_weight_encoding="deltas"),
                      [trainer], [LocalEngineLink(receiver, "in-process")])
    sync.setup()
    for version in (1, 2, 3):
        if version > 1:
            trainer.train_step()
        metrics = sync.push(version)
        assert metrics["sync/mode"] == (0.0 if version == 1 else 1.0)
        want = {n: checksum(t) for n, t in trainer.hf_weights()}
        assert receiver.weights_checksum()["checksums"] == want
    import fsspec

    assert fsspec.filesystem("memory").ls("/raygym-sync") == []


def test_engines_that_never_join_are_named_within_the_timeout(tiny_model_path):
    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    trainer = LocalTrainer(tiny_model_path)
    sync = WeightSync(recipe("nccl", update_weight_timeout=3.0), [trainer],
                      [HttpEngineLink(dead, "engine-dead"), HttpEngineLink(silent_url, "engine-silent")],
                      spec_overrides={"master_address": "127.0.0.1"})
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as err:
            sync.setup()
    finally:
        silent.close()
    elapsed = time.monotonic() - start
    assert "engine-dead" in str(err.value) and "engine-silent" in str(err.value)
    assert "update_weight_timeout=3.0" in str(err.value)
    assert elapsed < 15, f"took {elapsed:.1f}s to report engines that never joined"


class CorruptingLink:
    """Forwards to a real engine, but flips one byte of the first shard's bucket data before the engine
    reads a given version (a disk that corrupts a file)."""

    def __init__(self, inner: HttpEngineLink, version: int):
        self.inner, self.version, self.name, self.corrupted = inner, version, inner.name, False

    def call(self, endpoint, body, timeout):
        if endpoint is Endpoint.UPDATE_WEIGHTS_FROM_DISK and body.weight_version == str(self.version) \
                and not self.corrupted:
            self.corrupted = True
            flip_bucket_byte(os.path.join(body.model_path, "shard-00000.safetensors"))
        return self.inner.call(endpoint, body, timeout)


def flip_bucket_byte(path: str) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        (bucket,) = [v for k, v in header.items() if k.startswith("__raygym_bucket__")]
        pos = 8 + header_len + bucket["data_offsets"][0] + 40  # inside the first entry's payload
        data[pos] ^= 0x01
        f.seek(0)
        f.write(data)


def test_corrupted_shard_fails_checksum_and_triggers_full_resync(servers, tiny_model_path, tmp_path):
    trainer = LocalTrainer(tiny_model_path)
    links = [CorruptingLink(HttpEngineLink(servers[0], "engine0"), version=2), HttpEngineLink(servers[1], "engine1")]
    sync = WeightSync(recipe("disk", update_weight_disk_dir=str(tmp_path / "sync")), [trainer], links,
                      spec_overrides={"cast_dtype": ENGINE_DTYPE})
    sync.setup()
    assert sync.push(1)["sync/full_resyncs"] == 0.0
    trainer.train_step()
    metrics = sync.push(2)
    assert links[0].corrupted
    assert metrics["sync/full_resyncs"] == 1.0 and metrics["sync/resynced"] == 1.0
    assert metrics["sync/mode"] == 0.0  # the resync was a full payload
    want = trainer.engine_checksums()
    for url in servers:
        version, got = engine_checksums(url)
        assert version == "2" and {n: got[n] for n in want} == want
    trainer.train_step()
    after = sync.push(3)  # the snapshot advanced after the resync: deltas work again
    assert after["sync/mode"] == 1.0 and after["sync/resynced"] == 0.0


def test_disk_version_without_done_marker_is_refused(servers, tmp_path):
    """A manifest without DONE is a version still being written (or whose writer died): never load it."""
    version = tmp_path / "v000009"
    version.mkdir()
    (version / "manifest.json").write_text(json.dumps({"format": "raygym.bucket.v1", "version": 9, "shards": []}))
    before = engine_checksums(servers[0])
    r = httpx.post(f"{servers[0]}/update_weights_from_disk",
                   json={"model_path": str(version), "load_format": LOADER, "weight_version": "9"}, timeout=30)
    answer = r.json()
    assert answer["success"] is False and "no DONE marker" in answer["message"]
    assert engine_checksums(servers[0]) == before  # nothing loaded, version unchanged


def test_receive_side_broadcast_times_out_instead_of_hanging(servers):
    """The server joined a group, was told to receive a bucket, and the sender never broadcasts: the
    server must answer with a timeout error after its --weight-update-timeout, not hang."""
    from concurrent.futures import ThreadPoolExecutor

    from raygym.weightsync.payload import BUCKET_NAME, MANIFEST_NAME
    from raygym.weightsync.transport_dist import free_port, join_group

    url, port, name = servers[0], free_port("127.0.0.1"), "rg_silent_sender"
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(httpx.post, f"{url}/init_weights_update_group", timeout=60, json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": "gloo"})
        pg = join_group("127.0.0.1", port, 0, 2, name, "gloo", SERVER_TIMEOUT_S)
        assert joined.result().json()["success"] is True
        start = time.monotonic()
        r = httpx.post(f"{url}/update_weights_from_distributed", timeout=60, json={
            "names": [MANIFEST_NAME, BUCKET_NAME], "dtypes": ["uint8", "uint8"], "shapes": [[64], [1024]],
            "group_name": name, "load_format": LOADER, "weight_version": "99"})
        elapsed = time.monotonic() - start
    answer = r.json()
    assert answer["success"] is False and "TimeoutError" in answer["message"], answer
    assert SERVER_TIMEOUT_S - 1 <= elapsed < SERVER_TIMEOUT_S + 15, elapsed
    assert engine_checksums(servers[0])[0] != "99"
    httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": name}, timeout=30)
    del pg


def test_a_bucket_an_engine_cannot_load_is_named_and_the_group_stays_usable(servers, tiny_model_path):
    """Answers are awaited one bucket late; a failed bucket still fails the push with the engines
    named, and because every engine received every broadcast bucket, the next push works."""
    trainer = LocalTrainer(tiny_model_path)
    spec = SenderSpec.from_recipe(recipe("nccl", update_weight_mode="full"), list(servers), cast_dtype=ENGINE_DTYPE,
                                  master_address="127.0.0.1")
    sync = RankWeightSync(0)
    sync.init(spec)
    try:
        def with_stranger():
            yield from trainer.hf_weights()
            yield "model.no_such_layer.weight", torch.ones(4)

        with pytest.raises(WeightSyncError) as err:
            sync.push(1, with_stranger())
        assert "no parameter of that HF name" in str(err.value)
        assert servers[0] in str(err.value) and servers[1] in str(err.value)
        sync.discard()
        result = sync.push(2, trainer.hf_weights())
        sync.commit(2)
        assert result["metrics"]["sync/buckets"] > 1  # the tiny model spans several 64 KiB buckets
        want = trainer.engine_checksums()
        for url in servers:
            version, got = engine_checksums(url)
            assert version == "2" and {n: got[n] for n in want} == want
    finally:
        sync.close()
