"""The sender posts bucket k+1's request while bucket k's answer is still outstanding, so an engine holds the
next request before it finishes the current one (no request round trip between two buckets on the wire).

The link to a real raygym server here hands the transport answer k only once the transport posted request
k+1: a sender that waited for answer k before posting k+1 would never get there, and every held answer
would give up after ``HOLD_S``."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from raygym.config import Recipe
from raygym.engine_api.protocol import Endpoint
from raygym.weightsync.codec import checksum
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.engine_link import HttpEngineLink
from tests.weightsync.local_trainer import LocalTrainer
from tests.weightsync.raygym_servers import raygym_servers

HOLD_S = 20.0  # how long an answer is held waiting for the next request (a serialising sender runs into it)
REQUEST = Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED


class AnswersAfterTheNextRequest:
    """An engine link; while ``hold_answers`` is set (the number of requests of the push), the answer to each
    weight request but the last is handed back only once the next request was posted."""

    def __init__(self, inner: HttpEngineLink):
        self.inner, self.name = inner, inner.name
        self.hold_answers = 0
        self.posted: list[threading.Event] = []
        self.held: list[bool] = []  # per held answer: the next request came (True) or it gave up (False)
        self._lock = threading.Lock()

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        if endpoint is not REQUEST or not self.hold_answers:
            return self.inner.call(endpoint, body, timeout)
        with self._lock:
            index = len(self.posted)
            self.posted.append(threading.Event())
            if index > 0:
                self.posted[index - 1].set()  # the request before this one may be answered now
        answer = self.inner.call(endpoint, body, timeout)
        if index < self.hold_answers - 1:
            came = self.posted[index].wait(HOLD_S)
            with self._lock:
                self.held.append(came)
        return answer


def full_gloo_sync(trainer: LocalTrainer, link: Any) -> WeightSync:
    """Full syncs over gloo in 64 KiB buckets (several per push of the tiny model) to the engine behind ``link``."""
    recipe = Recipe(update_weight_transport="nccl", update_weight_mode="full", update_weight_buffer_size=64 * 1024,
                    update_weight_timeout=60.0, update_weight_full_interval=0, colocate=False)
    sync = WeightSync(recipe, [trainer], [link], spec_overrides={"master_address": "127.0.0.1", "backend": "gloo"})
    sync.setup()
    return sync


def assert_holds(url: str, trainer: LocalTrainer, version: int) -> None:
    """The engine at ``url`` serves ``version`` with exactly the trainer's weights."""
    got = httpx.post(f"{url}/raygym/weights_checksum", json={"names": None}, timeout=30).json()
    assert got == {"weight_version": str(version), "checksums": {n: checksum(t) for n, t in trainer.hf_weights()}}


def test_request_k_plus_1_is_posted_before_answer_k_is_in(tiny_model_path):
    trainer = LocalTrainer(tiny_model_path, lr=1e-3)
    with raygym_servers(tiny_model_path, 1, "float32") as (url,):
        link = AnswersAfterTheNextRequest(HttpEngineLink(url, "held-answers"))
        sync = full_gloo_sync(trainer, link)
        try:
            buckets = int(sync.push(1)["sync/buckets"])  # answers pass at once; the next push has as many buckets
            assert buckets >= 4, buckets  # enough for the pipelining to matter
            link.hold_answers = buckets
            trainer.train_step()
            metrics = sync.push(2)
            assert metrics["sync/buckets"] == buckets and metrics["sync/full_resyncs"] == 0.0
            assert sorted(link.held) == [True] * (buckets - 1), link.held
            assert_holds(url, trainer, version=2)
        finally:
            sync.shutdown()


class CountsRequests:
    """An engine link that signals each weight request as it is posted (``posted(k)``: request k went out)."""

    def __init__(self, inner: HttpEngineLink):
        self.inner, self.name = inner, inner.name
        self.count = 0  # weight requests posted so far
        self._posted: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def posted(self, index: int) -> threading.Event:
        with self._lock:
            return self._posted.setdefault(index, threading.Event())

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        if endpoint is REQUEST:
            with self._lock:
                index, self.count = self.count, self.count + 1
            self.posted(index).set()
        return self.inner.call(endpoint, body, timeout)


def test_request_k_plus_1_travels_while_bucket_k_is_on_the_wire(tiny_model_path, monkeypatch):
    """Over gloo, request k+1 is posted once bucket k's manifest reached the engine, so it is queued there
    before bucket k's buffer is through: here the sender's broadcast of buffer k waits until request k+1 was
    posted, which a sender posting k+1 only after buffer k was sent would never do (each wait gives up)."""
    from raygym.weightsync import transport_dist

    trainer = LocalTrainer(tiny_model_path, lr=1e-3)
    with raygym_servers(tiny_model_path, 1, "float32") as (url,):
        link = CountsRequests(HttpEngineLink(url, "counted"))
        sync = full_gloo_sync(trainer, link)
        try:
            buckets = int(sync.push(1)["sync/buckets"])
            assert buckets >= 4, buckets
            first = link.count  # requests of push 1
            came: list[bool] = []
            calls = [0]
            plain = transport_dist.broadcast

            def broadcast_after_the_next_request(pg: Any, tensor: Any, timeout_s: float) -> None:
                index, calls[0] = calls[0], calls[0] + 1
                bucket, is_buffer = divmod(index, 2)
                if is_buffer and bucket < buckets - 1:  # buffer k: request k+1 should be out already
                    came.append(link.posted(first + bucket + 1).wait(HOLD_S))
                plain(pg, tensor, timeout_s)

            monkeypatch.setattr(transport_dist, "broadcast", broadcast_after_the_next_request)
            trainer.train_step()
            metrics = sync.push(2)
            assert metrics["sync/buckets"] == buckets and metrics["sync/full_resyncs"] == 0.0
            assert came == [True] * (buckets - 1), came
            assert_holds(url, trainer, version=2)
        finally:
            monkeypatch.undo()
            sync.shutdown()
