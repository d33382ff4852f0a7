"""HttpEngineLink keeps its connections (weight-sync control calls must not pay a new client each), sends the
protocol's request models and parses the answers with the route's answer model."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raygym.engine_api.protocol import (
    Endpoint,
    PauseGeneration,
    StatusAnswer,
    WeightsChecksum,
    WeightsChecksumResponse,
)
from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import HttpEngineLink, checked


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    peers: list[tuple[str, int]] = []
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).peers.append(self.client_address)
        type(self).bodies.append(body)
        if self.path == Endpoint.RAYGYM_WEIGHTS_CHECKSUM.value:  # the "fail" engine: the weight route refuses
            status, answer = 500, {"error": {"message": "boom"}}
        else:
            status, answer = 200, {"message": "Generation paused successfully.", "status": "ok", "echo": body}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server():
    _Handler.peers, _Handler.bodies = [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_calls_reuse_one_pooled_connection(server):
    link = HttpEngineLink(server, name="engine0")
    modes = ["abort", "in_place", "retract", "abort", "in_place"]
    answers = [checked(link, Endpoint.PAUSE_GENERATION, PauseGeneration(mode=m), timeout=10) for m in modes]
    assert all(isinstance(a, StatusAnswer) and a.status == "ok" for a in answers)
    assert [a.echo["mode"] for a in answers] == modes  # fields the answer model does not name stay readable
    assert _Handler.bodies == [{"mode": m} for m in modes]  # the fields the caller set, nothing else
    assert len(set(_Handler.peers)) == 1  # one TCP connection for all five calls


def test_http_error_becomes_weight_sync_error_naming_the_engine(server):
    with pytest.raises(WeightSyncError, match=r"engine0: /raygym/weights_checksum answered failure \(HTTP 500\): boom"):
        checked(HttpEngineLink(server, name="engine0"), Endpoint.RAYGYM_WEIGHTS_CHECKSUM, WeightsChecksum(), 10)


def test_a_body_of_another_route_is_refused_before_sending(server):
    with pytest.raises(WeightSyncError, match="takes WeightsChecksum"):
        checked(HttpEngineLink(server, name="engine0"), Endpoint.RAYGYM_WEIGHTS_CHECKSUM, PauseGeneration(), 10)
    assert _Handler.bodies == []


def test_an_answer_the_route_model_refuses_is_an_error():
    class Link:
        name = "engine1"

        def call(self, endpoint, body, timeout):
            return {"checksums": "not a mapping"}

    with pytest.raises(WeightSyncError, match="engine1.*WeightsChecksumResponse"):
        checked(Link(), Endpoint.RAYGYM_WEIGHTS_CHECKSUM, WeightsChecksum(names=["w"]), 10)
    assert WeightsChecksumResponse.model_validate({"weight_version": "1", "checksums": {"w": "ab"}}).checksums == {
        "w": "ab"}
