"""raygym's inference server over real HTTP on 127.0.0.1 (one server process for the module).

Tests that change server state (weights, pause, memory) put it back before they end.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import BaseModel

from raygym.builtin import build_tiny_model
from raygym.engine_api.client import EngineClient, EngineHTTPError
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import free_port
from raygym.engines.raygym_server.server import tensor_checksum
from raygym.engines.serving.weight_receiver import destroy_group
from raygym.weightsync.transport_dist import broadcast, join_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the in-process reference forwards
REPO = Path(__file__).resolve().parents[2]
LOADER_MODULE = "rg_test_additive_loader"


@pytest.fixture(scope="module")
def loader_dir(tmp_path_factory) -> Path:
    """A custom weight loader with different semantics from the default copy: it adds."""
    d = tmp_path_factory.mktemp("loader")
    (d / f"{LOADER_MODULE}.py").write_text(
        textwrap.dedent(
            """
            import torch

            def add(model, named_tensors):
                params = dict(model.named_parameters())
                with torch.no_grad():
                    for name, tensor in named_tensors:
                        params[name].add_(tensor.to(params[name].dtype))
            """
        )
    )
    return d


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """The builtin tiny model with a long context, so long generations outlast the test's actions."""
    from raygym.builtin import TINY_MODEL, materialize_model

    return materialize_model(
        TINY_MODEL, tmp_path_factory.mktemp("long-ctx"), seed=0, max_position_embeddings=1 << 16
    )


@pytest.fixture(scope="module")
def server(model_path, loader_dir, tmp_path_factory):
    port = free_port("127.0.0.1")
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(loader_dir), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable,
        "-m",
        "raygym.engines.raygym_server.server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--weight-version",
        "0",
        "--seed",
        "5",
        "--custom-weight-loader",
        f"{LOADER_MODULE}:add",
        "--weight-update-timeout",
        "60",
        "--weight-source",
        str(tmp_path_factory.getbasetemp()),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        run(url, lambda c: c.wait_healthy(lambda: proc.poll() is None, timeout=120))
    except Exception:
        proc.kill()
        raise AssertionError(f"server did not start:\n{log.read_text()[-3000:]}") from None
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def ref_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def wire(answer):
    """An answer the client parsed, as the JSON the server sent (the fields it carried, nothing added)."""
    if isinstance(answer, list):
        return [wire(a) for a in answer]
    return answer.model_dump(exclude_unset=True) if isinstance(answer, BaseModel) else answer


def run(url: str, fn):
    """Run ``fn(client)`` (a coroutine factory) with a fresh EngineClient; answers as the server sent them."""

    async def go():
        async with EngineClient(url, timeout=120) as client:
            return wire(await fn(client))

    return asyncio.run(go())


def generate(client: EngineClient, body: dict):
    """``/generate`` of a request given as its JSON body."""
    return client.generate(GenerateRequest.model_validate(body))


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def greedy_ids(url: str, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    out = run(
        url,
        lambda c: generate(c,
            {
                "input_ids": prompts,
                "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            }
        ),
    )
    return [o["output_ids"] for o in out]


PROMPTS = [[2, 3, 4, 5], [10, 11], [7, 8, 9, 20, 21, 22]]


def test_generate_greedy_batch_matches_hf_and_logprobs_match_log_softmax(server, ref_model):
    out = run(
        server,
        lambda c: generate(c,
            {
                "input_ids": PROMPTS,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            }
        ),
    )
    assert isinstance(out, list) and len(out) == len(PROMPTS)
    for prompt, o in zip(PROMPTS, out, strict=True):
        assert o["output_ids"] == greedy_reference(ref_model, prompt, 8)
        meta = o["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (
            len(prompt),
            8,
            "0",
        )
        assert [t for _, t, _ in meta["output_token_logprobs"]] == o["output_ids"]
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + o["output_ids"]])).logits[0, len(prompt) - 1 : -1]
        expected = (
            torch.log_softmax(logits.float(), -1)
            .gather(-1, torch.tensor(o["output_ids"])[:, None])
            .squeeze(-1)
        )
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sampled_logprobs_use_temperature_scaled_logits(server, ref_model):
    prompt = [4, 5, 6]
    o = run(
        server,
        lambda c: generate(c,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "rid": "sampled-1",
                "sampling_params": {
                    "temperature": 0.6,
                    "top_p": 0.9,
                    "top_k": 10,
                    "max_new_tokens": 10,
                    "ignore_eos": True,
                    "sampling_seed": 3,
                },
            }
        ),
    )
    assert o["meta_info"]["id"] == "sampled-1"
    ids = o["output_ids"]
    with torch.no_grad():
        logits = ref_model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits / 0.6, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    got = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_text_input_n_samples_seed_and_stop_string(server):
    base = {
        "text": "next:3=",
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 6,
            "n": 3,
            "ignore_eos": True,
            "sampling_seed": 9,
        },
    }
    a = run(server, lambda c: generate(c, base))
    b = run(server, lambda c: generate(c, base))
    assert isinstance(a, list) and len(a) == 3
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]  # same seed, same samples
    greedy = run(
        server,
        lambda c: generate(c,
            {
                "text": "next:3=",
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            }
        ),
    )
    assert isinstance(greedy, dict) and len(greedy["text"]) == 8
    stop = greedy["text"][3:5]
    cut = run(
        server,
        lambda c: generate(c,
            {
                "text": "next:3=",
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": 8,
                    "ignore_eos": True,
                    "stop": [stop],
                },
            }
        ),
    )
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == greedy["text"][: greedy["text"].index(stop)]
    stop_id = greedy["output_ids"][2]
    by_id = run(
        server,
        lambda c: generate(c,
            {
                "text": "next:3=",
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": 8,
                    "stop_token_ids": [stop_id],
                    "ignore_eos": True,
                },
            }
        ),
    )
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_id["output_ids"] == greedy["output_ids"][: greedy["output_ids"].index(stop_id) + 1]


@pytest.mark.parametrize(
    "body, needle",
    [
        ({}, "exactly one of"),
        ({"input_ids": [1], "text": "a"}, "exactly one of"),
        ({"input_ids": [999999]}, "vocab_size"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field"),
        ({"input_ids": [1], "stream": "yes"}, "stream"),
        ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid"),
    ],
)
def test_bad_generate_requests_answer_400_with_a_message(server, body, needle):
    r = httpx.post(f"{server}/generate", json=body, timeout=30)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


def test_stream_sends_each_decode_step_and_ends_with_the_whole_answer(server):
    body = {"input_ids": [[3, 4, 5], [6, 7]], "return_logprob": True, "sampling_params": [
        {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "n": 2}]}
    whole = run(server, lambda c: generate(c, body))

    async def stream(c):
        return [chunk async for chunk in c.generate_stream(GenerateRequest.model_validate(body))]

    chunks = run(server, stream)
    by_row: dict[int, list[dict]] = {}
    for chunk in chunks:
        by_row.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_row) == [0, 1, 2]  # one row per sample: prompt 0, then prompt 1's two samples
    for row, updates in by_row.items():
        # the first token goes out alone as soon as it is decoded; the rest follow as they come, coalesced into
        # one update per wake-up of the HTTP loop (a loaded machine may hand several tokens to one update)
        assert len(updates) >= 2 and len(updates[0]["output_ids"]) == 1
        assert all(u["meta_info"]["finish_reason"] is None for u in updates[:-1])
        for before, after in zip(updates, updates[1:], strict=False):  # cumulative: each extends the last
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            assert after["text"].startswith(before["text"])
        final = {k: v for k, v in updates[-1].items() if k != "index"}
        expected = whole[row]
        assert final["output_ids"] == expected["output_ids"] and final["text"] == expected["text"]
        assert final["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        assert final["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]
    raw = httpx.post(f"{server}/generate", json={**body, "stream": True}, timeout=60)
    frames = raw.text.split("\n\n")
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert frames[-2:] == ["data: [DONE]", ""] and all(f.startswith("data: {") for f in frames[:-2])


def test_a_stream_the_client_leaves_is_cancelled(server):
    async def leave_after_three(c):
        request = GenerateRequest(input_ids=[3, 4], rid="left", sampling_params={
            "temperature": 0, "max_new_tokens": 60000, "ignore_eos": True})
        seen = 0
        async for _ in c.generate_stream(request):
            seen += 1
            if seen == 3:
                break
        return seen

    assert run(server, leave_after_three) == 3
    _wait_pending(server, 0)  # its slot is free again: the server cancelled the request


def test_bad_json_and_bad_control_requests_answer_400(server):
    assert httpx.post(f"{server}/generate", content=b"{not json", timeout=30).status_code == 400
    r = httpx.post(f"{server}/pause_generation", json={"mode": "sideways"}, timeout=30)
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    assert httpx.post(f"{server}/abort_request", json={}, timeout=30).status_code == 200  # SGLang: a no-op
    r = httpx.post(f"{server}/abort_request", json={"rid": 5}, timeout=30)
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server}/update_weights_from_distributed",
        json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
        timeout=30,
    )
    assert r.status_code == 400 and "init_weights_update_group" in r.json()["error"]["message"]
    for body in ({}, {"new_version": ""}, {"new_version": True}, {"new_version": "3", "abort_all_requests": "no"}):
        r = httpx.post(f"{server}/update_weight_version", json=body, timeout=30)
        field = "abort_all_requests" if "abort_all_requests" in body else "new_version"
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


def test_update_weight_version_labels_the_weights_as_the_protocol_reads_it(server):
    before = httpx.get(f"{server}/get_weight_version", timeout=30).json()["weight_version"]
    try:
        r = httpx.post(f"{server}/update_weight_version", json={"new_version": 7, "abort_all_requests": False},
                       timeout=30)
        assert r.status_code == 200 and r.json()["new_version"] == "7"
        assert httpx.get(f"{server}/get_weight_version", timeout=30).json()["weight_version"] == "7"
    finally:
        httpx.post(f"{server}/update_weight_version", json={"new_version": str(before)}, timeout=30)


def test_health_model_info_and_flush_cache(server, model_path):
    assert run(server, lambda c: c.health())
    assert run(server, lambda c: c.health_generate())
    info = run(server, lambda c: c.get_model_info())
    assert info["model_path"] == model_path and info["is_generation"] is True
    assert info["weight_version"] == "0"
    assert httpx.get(f"{server}/get_weight_version", timeout=30).json() == {"weight_version": "0"}
    r = httpx.post(f"{server}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")


def _long_request(server: str, rid: str, max_new_tokens: int = 60000):
    """Start a long greedy generation in a thread; returns the future of its answer."""
    pool = ThreadPoolExecutor(1)
    body = {
        "input_ids": [3, 4],
        "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    return pool.submit(lambda: httpx.post(f"{server}/generate", json=body, timeout=120).json())


def _wait_pending(server: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while run(server, lambda c: c.stats())["pending"] != n:
        assert time.monotonic() < deadline, f"server never had {n} pending requests"
        time.sleep(0.02)


def _wait_parked(server: str, after: int, timeout: float = 30) -> None:
    """Wait until the engine's worker waits, having parked more than ``after`` times (a counter)."""
    deadline = time.monotonic() + timeout
    while not ((s := run(server, lambda c: c.stats()))["parked"] and s["parks"] > after):
        assert time.monotonic() < deadline, "the engine's worker never went back to waiting"
        time.sleep(0.02)


def _wait_generating(server: str, timeout: float = 30) -> None:
    """Wait until the running request has produced tokens (a counter, not a sleep)."""
    start = run(server, lambda c: c.stats())["generated_tokens"]
    deadline = time.monotonic() + timeout
    while run(server, lambda c: c.stats())["generated_tokens"] <= start:
        assert time.monotonic() < deadline, "the request never produced a token"
        time.sleep(0.02)


def test_abort_request_by_rid(server):
    fut = _long_request(server, "to-abort")
    _wait_pending(server, 1)
    _wait_generating(server)
    run(server, lambda c: c.abort_request("to-abort"))
    out = fut.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 60000


def test_pause_abort_mode_aborts_in_flight_and_holds_new_requests_until_continue(server):
    fut = _long_request(server, "in-flight")
    _wait_pending(server, 1)
    assert run(server, lambda c: c.pause_generation("abort")) == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    assert fut.result(timeout=60)["meta_info"]["finish_reason"]["type"] == "abort"
    parks = run(server, lambda c: c.stats())["parks"]
    late = _long_request(server, "late", max_new_tokens=5)
    # the health probe waits in line like any request (SGLang's behaviour): a paused engine is not a broken one
    probe = ThreadPoolExecutor(1).submit(lambda: httpx.get(f"{server}/health_generate", timeout=60).status_code)
    _wait_pending(server, 2)
    _wait_parked(server, after=parks)  # the worker saw the late requests and went back to waiting
    assert not late.done() and not probe.done() and run(server, lambda c: c.stats())["pending"] == 2
    run(server, lambda c: c.continue_generation())
    assert late.result(timeout=60)["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert probe.result(timeout=60) == 200


def test_pause_in_place_keeps_the_request_and_flush_cache_refuses(server, ref_model):
    n = 300
    fut = _long_request(server, "kept", max_new_tokens=n)
    _wait_pending(server, 1)
    run(server, lambda c: c.pause_generation("in_place"))
    try:
        assert run(server, lambda c: c.flush_cache()) is False  # a request is still in the batch
        assert not fut.done()
    finally:
        run(server, lambda c: c.continue_generation())
    out = fut.result(timeout=120)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    assert out["output_ids"][:16] == greedy_reference(ref_model, [3, 4], 16)
    assert run(server, lambda c: c.flush_cache()) is True


def test_concurrent_requests_are_served_by_one_batch(server):
    """Requests queued while paused in place start together: one batch serves all of them."""
    n = 12
    run(server, lambda c: c.pause_generation("in_place"))
    pool = ThreadPoolExecutor(n)
    try:
        futs = [pool.submit(greedy_ids, server, [[2 + i, 3]], 4) for i in range(n)]
        _wait_pending(server, n)
    finally:
        run(server, lambda c: c.continue_generation())
    results = [f.result(timeout=60) for f in futs]
    assert all(len(r[0]) == 4 for r in results)
    stats = run(server, lambda c: c.stats())
    assert stats["recent_batch_sizes"][-1] == n

    async def burst(client):
        before = (await client.stats())["batches"]
        await asyncio.gather(
            *(
                generate(client, {"input_ids": [5, i], "sampling_params": {"max_new_tokens": 4}})
                for i in range(16)
            )
        )
        return (await client.stats())["batches"] - before

    assert run(server, burst) < 16  # unpaused concurrent arrivals share batches too


def test_release_and_resume_memory(server):
    run(server, lambda c: c.release_memory_occupation())
    try:
        r = httpx.post(f"{server}/generate", json={"input_ids": [3]}, timeout=30)
        assert r.status_code == 400 and "resume_memory_occupation" in r.json()["error"]["message"]
        assert httpx.get(f"{server}/health_generate", timeout=30).status_code == 503
        assert run(server, lambda c: c.stats())["released"] == ["kv_cache", "weights"]
    finally:
        run(server, lambda c: c.resume_memory_occupation())
    assert len(greedy_ids(server, [[3]], 2)[0]) == 2


def _save_model(model, directory: Path) -> None:
    model.save_pretrained(directory)  # safetensors shards


def test_update_weights_from_disk_via_fsspec_url(server, tmp_path, model_path, ref_model):
    other, _ = build_tiny_model(seed=1, max_position_embeddings=1 << 16)
    _save_model(other, tmp_path / "v7")
    try:
        res = run(server, lambda c: c.update_weights_from_disk(f"file://{tmp_path / 'v7'}", weight_version=7))
        assert res["success"] is True and "7" in res["message"]
        info = run(server, lambda c: c.get_model_info())
        assert info["weight_version"] == "7"
        assert greedy_ids(server, PROMPTS) == [greedy_reference(other, p, 8) for p in PROMPTS]
        sums = run(server, lambda c: c.weights_checksum(["model.embed_tokens.weight"]))
        assert sums == {
            "weight_version": "7",
            "checksums": {"model.embed_tokens.weight": tensor_checksum(other.model.embed_tokens.weight)},
        }
        with pytest.raises(EngineHTTPError, match="no loadable checkpoint") as bad:
            run(server, lambda c: c.update_weights_from_disk(str(tmp_path / "missing")))
        assert bad.value.status == 400 and json.loads(bad.value.body)["success"] is False
    finally:
        run(server, lambda c: c.update_weights_from_disk(model_path, weight_version=0))
    assert greedy_ids(server, PROMPTS) == [greedy_reference(ref_model, p, 8) for p in PROMPTS]


def _join_and_send(
    server: str, port: int, tensors: list[tuple[str, torch.Tensor]], *, load_format=None, version=None
):

    """The test process is rank 0 of a 2-rank gloo group; it broadcasts while the server receives."""
    pool = ThreadPoolExecutor(2)
    joining = pool.submit(join_group, "127.0.0.1", port, 0, 2, "wsync", "gloo", 60)
    init = run(
        server,
        lambda c: c.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="wsync",
            backend="gloo",
        ),
    )
    assert init["success"] is True
    group = joining.result(timeout=60)

    def send():
        for _, t in tensors:
            broadcast(group, t.contiguous(), 60)

    return group, pool, send


def test_update_weights_from_distributed_gloo_default_and_custom_loader(server, ref_model):
    other, _ = build_tiny_model(seed=2, max_position_embeddings=1 << 16)
    named = list(other.state_dict().items())
    port = free_port("127.0.0.1")
    group, pool, send = _join_and_send(server, port, named)
    try:
        meta = dict(
            names=[n for n, _ in named],
            dtypes=[str(t.dtype) for _, t in named],
            shapes=[list(t.shape) for _, t in named],
        )
        sending = pool.submit(send)
        res = run(
            server, lambda c: c.update_weights_from_distributed(**meta, group_name="wsync", weight_version=3)
        )
        sending.result(timeout=60)
        assert res["success"] is True
        assert greedy_ids(server, PROMPTS) == [greedy_reference(other, p, 8) for p in PROMPTS]
        sums = run(server, lambda c: c.weights_checksum(None))
        assert sums["weight_version"] == "3"
        assert sums["checksums"] == {n: tensor_checksum(t) for n, t in other.state_dict().items()}

        # Custom loader named by load_format: adds a delta instead of copying.
        delta = [("lm_head.weight", torch.full_like(other.lm_head.weight, 0.25))]
        sending = pool.submit(lambda: [broadcast(group, t, 60) for _, t in delta])
        res = run(
            server,
            lambda c: c.update_weights_from_distributed(
                names=["lm_head.weight"],
                dtypes=["torch.float32"],
                shapes=[list(other.lm_head.weight.shape)],
                group_name="wsync",
                load_format=f"{LOADER_MODULE}.add",
                weight_version=4,
            ),
        )
        sending.result(timeout=60)
        assert res["success"] is True
        expected = other.lm_head.weight.detach() + 0.25
        got = run(server, lambda c: c.weights_checksum(["lm_head.weight"]))["checksums"]["lm_head.weight"]
        assert got == tensor_checksum(expected)

        # Unknown names: 400 naming them, and the sender's broadcast still completes.
        junk = [("model.no_such.weight", torch.ones(3))]
        sending = pool.submit(lambda: [broadcast(group, t, 60) for _, t in junk])
        with pytest.raises(EngineHTTPError, match="no_such") as bad:
            run(
                server,
                lambda c: c.update_weights_from_distributed(
                    names=["model.no_such.weight"], dtypes=["float32"], shapes=[[3]], group_name="wsync"
                ),
            )
        sending.result(timeout=60)
        assert bad.value.status == 400
        with pytest.raises(EngineHTTPError, match="not a registered custom weight loader"):
            run(
                server,
                lambda c: c.update_weights_from_distributed(
                    names=["lm_head.weight"],
                    dtypes=["float32"],
                    shapes=[[1]],
                    group_name="wsync",
                    load_format="pkg.nope",
                ),
            )
    finally:
        destroyed = run(server, lambda c: c.destroy_weights_update_group("wsync"))
        destroy_group(group, "wsync")
        pool.shutdown(wait=False)
        restore = list(ref_model.state_dict().items())
        port2 = free_port("127.0.0.1")
        g2, pool2, send2 = _join_and_send(server, port2, restore)
        sending = pool2.submit(send2)
        run(
            server,
            lambda c: c.update_weights_from_distributed(
                names=[n for n, _ in restore],
                dtypes=[str(t.dtype) for _, t in restore],
                shapes=[list(t.shape) for _, t in restore],
                group_name="wsync",
                weight_version=0,
            ),
        )
        sending.result(timeout=60)
        run(server, lambda c: c.destroy_weights_update_group("wsync"))
        destroy_group(g2, "wsync")
    assert destroyed["success"] is True
    assert greedy_ids(server, PROMPTS) == [greedy_reference(ref_model, p, 8) for p in PROMPTS]


def test_weights_checksum_matches_the_checkpoint(server, ref_model):
    sums = run(server, lambda c: c.weights_checksum(None))
    assert sums["checksums"] == {n: tensor_checksum(t) for n, t in ref_model.state_dict().items()}
    r = httpx.post(f"{server}/raygym/weights_checksum", json={"names": ["nope"]}, timeout=30)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
