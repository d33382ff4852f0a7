"""raygym's server under bad input, limits, faults and hostile requests (one server for the module, real
HTTP on 127.0.0.1, an API key in its environment). Every malformed body is a 4xx naming the field, a
failed weight update changes nothing, limits answer 4xx/5xx instead of growing without bound, a client that
goes away frees its slot, and nothing without the key, or from a web page, changes the engine."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from raygym.builtin import TINY_MODEL, build_tiny_model, materialize_model
from raygym.engines.actor import free_port

KEY = "robustness-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256  # the builtin tiny model's max_position_embeddings
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return materialize_model(TINY_MODEL, tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


@contextlib.contextmanager
def start_server(model_path: str, extra_args: tuple[str, ...] = (), extra_env: dict | None = None):
    """raygym's server on a free port of 127.0.0.1 (its log in a temp file); ended by its own process group."""
    port = free_port("127.0.0.1")
    log = Path(tempfile.mkdtemp(prefix="rg-server-")) / "server.log"
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "raygym.engines.raygym_server.server", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", *extra_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not healthy in 180 s"
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(model_path, weights_dir):
    with start_server(model_path, ("--max-n", "8", "--max-queued-requests", "64", "--max-body-bytes", str(1 << 20),
                                   "--weight-update-timeout", "5", "--weight-source", str(weights_dir)),
                      {"RAYGYM_ENGINE_API_KEY": KEY}) as url:
        yield url


def post(url: str, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60, **kw)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/raygym/stats", headers=AUTH, timeout=30).json()


def greedy(url: str, prompt=(3, 4, 5), n=6) -> list[int]:
    r = post(url, "/generate", {"input_ids": list(prompt),
                                "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def checksums(url: str) -> dict:
    return post(url, "/raygym/weights_checksum", {"names": None}).json()


def wait_for(predicate, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ----- malformed input: a 4xx naming the field, never a 500 -----
BAD_BODIES = [
    ({"input_ids": 5}, "input_ids"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": []}, "non-empty"),
    ({"text": ""}, "text"),
    ({"text": ["a", ""]}, "text"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**70}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 9}}, "sampling_params.n"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT}}, "context length"),
    ({"input_ids": [1] * CONTEXT}, "longer than the model's context length"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
]


@pytest.mark.parametrize("body, field", BAD_BODIES)
def test_malformed_generate_bodies_are_4xx_naming_the_field(server, body, field):
    r = post(server, "/generate", body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("raw", [b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}',
                                 b'{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}',
                                 b'{"input_ids": [1, 2], "text": "\xff\xfe"}', b'[1, 2]', b'{"input_ids": '])
def test_non_json_and_non_finite_numbers_are_refused(server, raw):
    r = httpx.post(f"{server}/generate", content=raw, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "body" in r.json()["error"]["message"] or "NaN" in r.text or "Infinity" in r.text


@pytest.mark.parametrize("path, body, field", [
    ("/release_memory_occupation", {"tags": [[1]]}, "tags"),
    ("/resume_memory_occupation", {"tags": ["everything"]}, "tags"),
    ("/raygym/weights_checksum", {"names": [[1]]}, "names"),
    ("/pause_generation", {"mode": 3}, "mode"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/update_weights_from_distributed", {"names": "w", "dtypes": [], "shapes": []}, "names"),
    ("/update_weights_from_disk", {"model_path": 7}, "model_path"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, "serialized_named_tensors"),
])
def test_malformed_control_bodies_are_4xx_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
    assert field in r.text, r.text


def test_state_changing_routes_take_sglangs_methods_and_no_browser(server):
    # SGLang serves /flush_cache on GET and POST; its tests, slime and verl flush with GET.
    assert httpx.get(f"{server}/flush_cache", headers=AUTH, timeout=30).status_code == 200
    for method, path in (("GET", "/pause_generation"), ("PUT", "/flush_cache"), ("DELETE", "/generate"),
                         ("GET", "/update_weights_from_disk"), ("POST", "/health")):
        r = httpx.request(method, f"{server}{path}", headers=AUTH, timeout=30)
        assert r.status_code == 405, (method, path, r.text)
        assert "not allowed" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/pause_generation", content=b'{"mode": "abort"}',
                   headers={**AUTH, "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415
    r = httpx.post(f"{server}/flush_cache", headers={**AUTH, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 403
    for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        r = httpx.get(f"{server}/release_memory_occupation", headers={**AUTH, **headers}, timeout=30)
        assert r.status_code == 403, r.text  # a page's <img src> cannot release the engine's memory
    assert post(server, "/abort_request", {}).status_code == 200  # SGLang's no-op


def test_nothing_happens_without_the_api_key(server):
    before = checksums(server)
    for path, body in (("/generate", {"input_ids": [1, 2]}), ("/pause_generation", {"mode": "abort"}),
                       ("/update_weights_from_disk", {"model_path": "/tmp"}), ("/raygym/weights_checksum", {})):
        r = httpx.post(f"{server}{path}", json=body, timeout=30)
        assert r.status_code == 401, (path, r.text)
        r = httpx.post(f"{server}{path}", json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    assert checksums(server) == before


def test_a_body_over_the_limit_is_413(server):
    r = post(server, "/generate", {"input_ids": [1] * 800_000})  # ~1.6 MB of JSON
    assert r.status_code == 413, r.text


# ----- limits -----
def test_a_full_queue_answers_503_and_nothing_of_the_request_is_queued(server):
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    pool = ThreadPoolExecutor(2)
    try:
        filling = pool.submit(post, server, "/generate", {
            "input_ids": [[2, 3]] * 60, "sampling_params": {"max_new_tokens": 2}})
        wait_for(lambda: stats(server)["pending"] == 60, what="60 queued sequences")
        r = post(server, "/generate", {"input_ids": [[4, 5]] * 5, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
        assert stats(server)["pending"] == 60  # all or nothing
    finally:
        post(server, "/continue_generation", {})
    assert filling.result(timeout=120).status_code == 200


def test_a_client_that_disconnects_frees_its_slot(server):
    body = json.dumps({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 250, "ignore_eos": True,
                                                                 "temperature": 0}}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head + body)
        wait_for(lambda: stats(server)["pending"] == 1, what="the request to run")
    before = stats(server)["generated_tokens"]
    wait_for(lambda: stats(server)["pending"] == 0, timeout=20, what="the disconnected request to be cancelled")
    assert stats(server)["generated_tokens"] - before < 200  # it stopped well before its 250 tokens


# ----- isolation: a bad neighbour does not take the batch down -----
def test_a_refused_request_leaves_the_running_batch_alone(server):
    pool = ThreadPoolExecutor(4)
    body = {"input_ids": [[3, 4]] * 4, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
    running = pool.submit(post, server, "/generate", body)
    wait_for(lambda: stats(server)["pending"] == 4, what="the batch to run")
    bad = post(server, "/generate", {"input_ids": []})
    assert bad.status_code == 400
    answers = running.result(timeout=120).json()
    assert [a["meta_info"]["finish_reason"] for a in answers] == [{"type": "length", "length": 120}] * 4


# ----- weight updates are all or nothing -----
def save_checkpoint(model, path: Path, extra: dict | None = None, drop: str | None = None, shards: int = 2) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != drop}
    state.update(extra or {})
    names = sorted(state)
    path.mkdir(parents=True, exist_ok=True)
    per = -(-len(names) // shards)
    for i in range(shards):
        save_file({n: state[n] for n in names[i * per:(i + 1) * per]}, str(path / f"model-{i:05d}.safetensors"))


@pytest.mark.parametrize("case", ["unknown_name", "shape_mismatch", "corrupt_second_shard"])
def test_a_checkpoint_that_fails_part_way_changes_nothing(server, weights_dir, case):
    other, _ = build_tiny_model(seed=7)
    path = weights_dir / case
    if case == "unknown_name":
        save_checkpoint(other, path, extra={"model.layers.9.nope.weight": torch.ones(3)})
    elif case == "shape_mismatch":
        save_checkpoint(other, path, extra={"lm_head.weight": torch.ones(3, 3)})
    else:
        save_checkpoint(other, path)
        second = sorted(path.glob("*.safetensors"))[1]
        second.write_bytes(second.read_bytes()[:100] + b"\x00" * 64)
    before_sums, before_out = checksums(server), greedy(server)
    r = post(server, "/update_weights_from_disk", {"model_path": str(path), "weight_version": "99"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "unchanged" in r.json()["message"]
    assert checksums(server) == before_sums  # every tensor and the version label as they were
    assert greedy(server) == before_out


# ----- closed doors -----
class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_weights_come_only_from_configured_sources_and_errors_say_nothing(server, weights_dir, tmp_path):
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        answers = []
        for path in (f"http://127.0.0.1:{httpd.server_port}/model", str(tmp_path / "outside"),
                     str(weights_dir / "missing"), "/etc", f"{weights_dir}/../../etc"):
            r = post(server, "/update_weights_from_disk", {"model_path": path})
            assert r.status_code == 400
            answers.append(r.json()["message"].replace(path, "<path>"))
        assert len(set(answers)) == 1, answers  # missing and forbidden read the same
        assert _Recorder.hits == []  # no outbound fetch was made
    finally:
        httpd.shutdown()


def test_group_joins_are_validated_first_and_end_within_their_timeout(server):
    port = free_port("127.0.0.1")
    start = time.monotonic()
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": 0, "world_size": 2, "backend": "gloo"})
    assert r.status_code == 400 and "rank_offset=0" in r.json()["message"]
    with socket.socket() as probe:  # the engine opened no store on that port
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": 5, "world_size": 2, "backend": "gloo"})
    assert r.status_code == 400 and "outside world_size" in r.json()["message"]
    assert time.monotonic() - start < 5  # refused before any waiting
    start = time.monotonic()
    r = post(server, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": 1, "world_size": 2, "backend": "gloo",
                                                    "group_name": "nobody_hosts"})
    elapsed = time.monotonic() - start
    assert r.status_code == 400 and r.json()["success"] is False
    assert elapsed < 5 + 4, f"a 5 s join took {elapsed:.1f} s"


def test_sglang_info_routes_answer_as_sglang_shapes_them(server):
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{server}{path}", headers=AUTH, timeout=30).json()
        assert info["context_length"] == CONTEXT and info["tp_size"] == 1 and info["max_running_requests"] > 0
        assert info["internal_states"][0]["weight_version"] == info["weight_version"]
    assert httpx.get(f"{server}/ping", timeout=30).status_code == 401  # SGLang exempts only /health* and /metrics
    assert httpx.get(f"{server}/ping", headers=AUTH, timeout=30).status_code == 200
