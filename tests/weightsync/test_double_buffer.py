"""Double-buffered receive and update_weight_mode='auto' against a real raygym server (its own process, HTTP
on 127.0.0.1, gloo): while a version loads into the shadow copy the server keeps generating on the old
one and reports the old weights; the switch serves the new version bit for bit; a shadow that fails
verification is never served; auto explores delta after the seeding full sync and keeps engines exact."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from raygym.config import Recipe
from raygym.engine_api.protocol import Endpoint, GenerateRequest, WeightsChecksum
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.engine_link import HttpEngineLink
from tests.weightsync.local_trainer import LocalTrainer
from tests.weightsync.raygym_servers import raygym_servers

pytestmark = pytest.mark.e2e

ENGINE_DTYPE = "bfloat16"
GENERATE = GenerateRequest(input_ids=[5, 9, 13, 2], sampling_params={"max_new_tokens": 3, "temperature": 0.0,
                                                                    "ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """One raygym server with raygym's loader registered; ended by its own handle."""
    with raygym_servers(tiny_model_path, 1, ENGINE_DTYPE, ["--weight-update-timeout", "20"]) as urls:
        yield urls[0]


def recipe(**over: Any) -> Recipe:
    fields: dict[str, Any] = dict(update_weight_transport="nccl", update_weight_mode="delta",
                                  update_weight_buffer_size=64 * 1024, update_weight_timeout=30.0,
                                  update_weight_pause_mode="abort", colocate=False)
    fields.update(over)
    return Recipe(**fields)


def served(url: str) -> tuple[str, dict[str, str]]:
    answer = httpx.post(f"{url}/raygym/weights_checksum", json={"names": None}, timeout=30).json()
    return answer["weight_version"], answer["checksums"]


class WatchingLink(HttpEngineLink):
    """The real HTTP link, recording every endpoint; just before each switch it checks that the engine is
    still serving the previous version (generation included) while the shadow holds the new one."""

    def __init__(self, url: str, trainer: LocalTrainer):
        super().__init__(url, "engine0")
        self.trainer = trainer
        self.calls: list[Endpoint] = []
        self.before_switch: list[dict[str, Any]] = []
        self.served_before: tuple[str, dict[str, str]] | None = None
        self.tamper_next_shadow_checksums = False

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        self.calls.append(endpoint)
        if endpoint is Endpoint.RAYGYM_SHADOW_SWITCH:
            out = super().call(Endpoint.GENERATE, GENERATE, timeout)
            version, checksums = served(self.base_url)
            shadow = super().call(Endpoint.RAYGYM_WEIGHTS_CHECKSUM, WeightsChecksum(names=None, shadow=True), timeout)
            self.before_switch.append({"generated": out, "version": version, "checksums": checksums,
                                       "shadow": shadow})
        if endpoint is Endpoint.RAYGYM_SHADOW_DISCARD:
            self.served_before = served(self.base_url)
        answer = super().call(endpoint, body, timeout)
        if endpoint is Endpoint.RAYGYM_WEIGHTS_CHECKSUM and body.shadow and self.tamper_next_shadow_checksums:
            self.tamper_next_shadow_checksums = False
            name = next(iter(answer["checksums"]))
            answer["checksums"][name] = "0" * 16
        return answer


def test_the_engine_serves_the_old_version_until_the_switch(server, tiny_model_path):
    trainer = LocalTrainer(tiny_model_path)
    link = WatchingLink(server, trainer)
    sync = WeightSync(recipe(update_weight_double_buffer=True), [trainer], [link],
                      spec_overrides={"cast_dtype": ENGINE_DTYPE, "master_address": "127.0.0.1"})
    sync.setup()
    try:
        history, wanted = [], []
        for version in (1, 2, 3):
            if version > 1:
                trainer.train_step()
            previous = served(server)
            history.append(sync.push(version))
            wanted.append(trainer.engine_checksums())
            seen = link.before_switch[-1]
            # loaded, verified, not yet served: generation ran on the previous version
            assert seen["generated"]["meta_info"]["finish_reason"]["type"] != "abort"
            assert seen["generated"]["meta_info"]["weight_version"] == previous[0]
            assert (seen["version"], seen["checksums"]) == previous
            assert seen["shadow"]["weight_version"] == str(version)
            assert {n: seen["shadow"]["checksums"][n] for n in wanted[-1]} == wanted[-1]
            got_version, got = served(server)
            assert got_version == str(version) and {n: got[n] for n in wanted[-1]} == wanted[-1]
    finally:
        sync.shutdown()
    assert Endpoint.PAUSE_GENERATION not in link.calls and Endpoint.FLUSH_CACHE not in link.calls
    assert [m["sync/mode"] for m in history] == [0.0, 1.0, 1.0]
    assert all(m["sync/full_resyncs"] == 0.0 and "sync/pause_s" in m for m in history)


def test_a_shadow_that_fails_verification_is_never_served(server, tiny_model_path):
    trainer = LocalTrainer(tiny_model_path)
    link = WatchingLink(server, trainer)
    sync = WeightSync(recipe(update_weight_double_buffer=True), [trainer], [link],
                      spec_overrides={"cast_dtype": ENGINE_DTYPE, "master_address": "127.0.0.1"})
    sync.setup()
    try:
        sync.push(1)
        served_v1 = served(server)
        trainer.train_step()
        link.tamper_next_shadow_checksums = True
        metrics = sync.push(2)
        assert link.served_before == served_v1  # the bad shadow was discarded while v1 was still served
        assert metrics["sync/full_resyncs"] == 1.0 and metrics["sync/mode"] == 0.0
        want = trainer.engine_checksums()
        got_version, got = served(server)
        assert got_version == "2" and {n: got[n] for n in want} == want
        trainer.train_step()
        assert sync.push(3)["sync/mode"] == 1.0  # deltas resume on top of the resynced shadow
    finally:
        sync.shutdown()


def test_auto_mode_measures_both_payloads_and_keeps_engines_exact(server, tiny_model_path):
    trainer = LocalTrainer(tiny_model_path)
    sync = WeightSync(recipe(update_weight_mode="auto"), [trainer], [server],
                      spec_overrides={"cast_dtype": ENGINE_DTYPE, "master_address": "127.0.0.1"})
    sync.setup()
    history = []
    try:
        for version in range(1, 6):
            if version > 1:
                trainer.train_step()
            history.append(sync.push(version))
            want = trainer.engine_checksums()
            got_version, got = served(server)
            assert got_version == str(version) and {n: got[n] for n in want} == want
    finally:
        sync.shutdown()
    assert history[0]["sync/mode"] == 0.0  # the seeding sync is full
    assert history[1]["sync/mode"] == 1.0 and history[1]["sync/explore"] == 1.0  # delta never measured yet
    assert "sync/predicted_full_s" in history[1] and "sync/predicted_delta_s" not in history[1]
    for m in history[2:]:
        assert m["sync/predicted_s"] > 0 and m["sync/measured_s"] > 0
        assert {"sync/predicted_full_s", "sync/predicted_delta_s"} <= set(m)
    assert all(m["sync/full_resyncs"] == 0.0 for m in history)
