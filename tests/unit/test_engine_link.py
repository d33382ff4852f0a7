"""HttpEngineLink keeps its connections: weight-sync control calls must not pay a new client each."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from raygym.errors import WeightSyncError
from raygym.weightsync.engine_link import HttpEngineLink, checked, http_client


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    peers: list[tuple[str, int]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).peers.append(self.client_address)
        status, answer = (500, {"error": "boom"}) if self.path == "/fail" else (200, {"success": True, "echo": body})
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
    _Handler.peers = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_calls_reuse_one_pooled_connection(server):
    link = HttpEngineLink(server, name="engine0")
    answers = [link.call("pause_generation", {"mode": "abort", "i": i}, timeout=10) for i in range(5)]
    assert [a["echo"]["i"] for a in answers] == list(range(5))
    assert len(set(_Handler.peers)) == 1  # one TCP connection for all five calls
    assert http_client() is http_client()


def test_http_error_becomes_weight_sync_error_naming_the_engine(server):
    with pytest.raises(WeightSyncError, match="engine0.*HTTP 500"):
        checked(HttpEngineLink(server, name="engine0"), "fail", {}, 10)
