"""raygym serve without Ray: request validation, the OpenAI front's translation to engine payloads, the
HTTP app (key check, OpenAI-shaped errors) through an in-process ASGI client, and the deployment
options. Answers are checked against the `openai` package's own response types."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import openai.types as oai
import openai.types.chat as oai_chat
import pytest
from pydantic import ValidationError

from raygym.builtin import build_tokenizer
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.errors import ConfigError
from raygym.serve.deployment import (
    API_KEY_ENV,
    ServeSettings,
    choose_frontend,
    deployment_options,
    read_api_key,
)
from raygym.serve.direct import bind, local_gpu_ids, mounted
from raygym.serve.front import OpenAIError, OpenAIFront, row_seed
from raygym.serve.http import authorized, build_http_app, key_digest, validation_error
from raygym.serve.protocol import ChatCompletionRequest, Completion, CompletionRequest

KEY = "serve-unit-key-0123456789"
MODEL = "tiny"


class RecordingEngine:
    """Answers batched /generate requests like SGLang: per row, echoes the prompt's last token plus a
    fixed tail, with log-probs, stopping by length; streamed, one update per token (SGLang's cumulative
    form, ``index`` = the row). Records every request as it goes on the wire."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.payloads: list[dict] = []

    def _answer(self, row: int, ids: list[int], out: list[int], finished: bool, length: int) -> GenerateResponse:
        return GenerateResponse.model_validate({
            "text": self.tokenizer.decode(out), "output_ids": out, "index": row,
            "meta_info": {"id": f"r{row}", "prompt_tokens": len(ids), "completion_tokens": len(out),
                          "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(out)],
                          "finish_reason": {"type": "length", "length": length} if finished else None}})

    def _rows(self, request: GenerateRequest):
        self.payloads.append(request.model_dump(exclude_unset=True))
        for row, (ids, params) in enumerate(zip(request.input_ids, request.sampling_params, strict=True)):
            yield row, ids, ([ids[-1]] + self.tokenizer.encode("ab", add_special_tokens=False))[: params["max_new_tokens"]]

    async def generate(self, request: GenerateRequest):
        return [self._answer(row, ids, out, True, len(out)) for row, ids, out in self._rows(request)]

    async def generate_stream(self, request: GenerateRequest):
        for row, ids, out in self._rows(request):
            for k in range(1, len(out) + 1):
                yield self._answer(row, ids, out[:k], k == len(out), len(out))


@pytest.fixture
def front():
    tok = build_tokenizer()
    engine = RecordingEngine(tok)
    return OpenAIFront(tok, engine, MODEL, context_len=32, default_max_tokens=5), engine


async def _events(started):
    return [frame async for frame in await started]


def test_request_validation_names_the_parameter():
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]}).prompts() == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [5, 6]}).prompts() == [[5, 6]]
    cases = [
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
        ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x"}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
         "response_format"),
        ({"model": "m", "messages": []}, "messages"),
    ]
    for body, param in cases:
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest
        with pytest.raises(ValidationError) as info:
            kind.model_validate(body)
        err = validation_error(info.value)
        assert (err.status, err.param) == (400, param), (body, err.message)
    ignored = CompletionRequest.model_validate({"model": "m", "prompt": "x", "user": "u", "store": False})
    assert ignored.choices == 1


def test_completion_rows_seeds_and_usage(front):
    f, engine = front
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": ["next:1=", "next:22="], "n": 2, "seed": 9,
                                            "max_tokens": 3, "temperature": 0.5, "stop": ["\n"], "logprobs": 0})
    generation = asyncio.run(f.complete(req))
    payload = engine.payloads[-1]
    assert len(payload["input_ids"]) == 4 and payload["return_logprob"] is True
    prompts = [f.encode("next:1="), f.encode("next:22=")]
    assert payload["input_ids"] == [prompts[0], prompts[0], prompts[1], prompts[1]]  # choice i of prompt p: p*n+i
    seeds = [p["sampling_seed"] for p in payload["sampling_params"]]
    assert seeds == [row_seed(9, 0, 0), row_seed(9, 0, 1), row_seed(9, 1, 0), row_seed(9, 1, 1)]
    assert len(set(seeds)) == 4
    assert payload["sampling_params"][0] == {"max_new_tokens": 3, "temperature": 0.5, "top_p": 1.0, "stop": ["\n"],
                                             "sampling_seed": seeds[0]}
    body = oai.Completion.model_validate(f.completion_body(req, generation).model_dump())
    assert [c.index for c in body.choices] == [0, 1, 2, 3]
    assert body.choices[2].text == "=ab" and body.choices[2].finish_reason == "length"
    assert body.choices[2].logprobs.tokens == ["=", "a", "b"] and body.choices[2].logprobs.text_offset == [0, 1, 2]
    assert body.choices[2].logprobs.token_logprobs == [-0.5, -1.5, -2.5]
    assert body.usage.prompt_tokens == 7 + 8 and body.usage.completion_tokens == 12 and body.usage.total_tokens == 27


def test_chat_uses_the_template_and_streams_openai_chunks(front):
    f, engine = front
    req = ChatCompletionRequest.model_validate({
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
        "messages": [{"role": "system", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]}],
    })
    frames = asyncio.run(_events(f.stream_chat(req)))
    expected = f.tokenizer.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
                                               tokenize=False, add_generation_prompt=True)
    assert engine.payloads[-1]["input_ids"] == [f.encode(expected)]
    assert engine.payloads[-1]["sampling_params"][0]["max_new_tokens"] == 5  # default_max_tokens
    assert frames[-1] == "data: [DONE]\n\n" and all(fr.startswith("data: ") and fr.endswith("\n\n") for fr in frames)
    chunks = [oai_chat.ChatCompletionChunk.model_validate(json.loads(fr[6:])) for fr in frames[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "bab"
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert contents == ["b", "a", "b"]  # one chunk per engine update, as they come
    logprobs = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert logprobs == [-0.5, -1.5, -2.5]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion_matches_the_whole_answer_row_by_row(front):
    f, _ = front
    body = {"model": MODEL, "prompt": ["next:1=", "next:22="], "n": 2, "max_tokens": 3, "logprobs": 0, "echo": True,
            "seed": 4}
    whole = f.completion_body(CompletionRequest.model_validate(body),
                              asyncio.run(f.complete(CompletionRequest.model_validate(body))))
    req = CompletionRequest.model_validate({**body, "stream": True, "stream_options": {"include_usage": True}})
    frames = asyncio.run(_events(f.stream_completion(req)))
    # OpenAI's streamed completion chunks carry finish_reason null until the last (its Completion type says non-null)
    chunks = [Completion.model_validate(json.loads(fr[6:])) for fr in frames[:-1]]
    assert frames[-1] == "data: [DONE]\n\n" and len({c.id for c in chunks}) == 1
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text  # the echoed prompt, then the tokens as they came
        assert len([p for p in parts if p.text]) == 3  # one chunk per update (the first carries the echo)
        assert [p.finish_reason for p in parts][-1] == choice.finish_reason == "length"
        tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
        offsets = [o for p in parts if p.logprobs for o in p.logprobs.text_offset]
        assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_front_errors(front):
    f, _ = front
    with pytest.raises(OpenAIError) as info:
        asyncio.run(f.complete(CompletionRequest.model_validate({"model": "other", "prompt": "x"})))
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")
    with pytest.raises(OpenAIError) as info:
        asyncio.run(f.complete(CompletionRequest.model_validate({"model": MODEL, "prompt": "next:1=", "max_tokens": 30})))
    assert info.value.code == "context_length_exceeded" and "37 tokens" in info.value.message
    with pytest.raises(OpenAIError, match="vocabulary"):
        asyncio.run(f.complete(CompletionRequest.model_validate({"model": MODEL, "prompt": [1, 10_000]})))


def _client(front_obj):
    from fastapi.testclient import TestClient

    return TestClient(build_http_app(front_obj, key_digest(KEY)))


def test_http_app_requires_the_key_and_answers_openai_errors(front):
    f, _ = front
    client = _client(f)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/nothing-here").status_code == 401  # the key is checked before routing
    models = oai.Model.model_validate(client.get("/v1/models", headers=auth).json()["data"][0])
    assert models.id == MODEL and client.get(f"/v1/models/{MODEL}", headers=auth).status_code == 200
    r = client.post("/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "parse" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.get("/v1/nothing-here", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/nothing-here)"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "next:3=", "max_tokens": 2}, headers=auth)
    assert oai.Completion.model_validate(r.json()).choices[0].text == "=a"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "next:3=", "stream": True}, headers=auth)
    assert r.headers["content-type"].startswith("text/event-stream") and r.text.endswith("data: [DONE]\n\n")


def test_engine_failures_map_to_openai_errors():
    from raygym.engine_api.client import EngineConnectionError, EngineHTTPError

    tok = build_tokenizer()

    class Failing:
        def __init__(self, error):
            self.error = error

        async def generate(self, request):
            raise self.error

        async def generate_stream(self, request):
            raise self.error
            yield  # an async generator that fails at its first update

    refusing = Failing(EngineHTTPError("http://e", "/generate", 400, '{"error": {"message": "top_k must be >= -1"}}'))
    gone = Failing(EngineConnectionError("http://e/generate: no answer in time"))
    auth = {"Authorization": f"Bearer {KEY}"}
    for stream in (False, True):  # a streamed request fails before its answer starts: the same status
        r = _client(OpenAIFront(tok, refusing, MODEL)).post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["message"].endswith("top_k must be >= -1")
        r = _client(OpenAIFront(tok, gone, MODEL)).post("/v1/chat/completions", headers=auth, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": stream})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_key_digest_and_authorized():
    digest = key_digest(KEY)
    assert KEY not in digest and len(digest) == 64
    assert authorized(f"Bearer {KEY}", digest) and authorized(f"bearer {KEY}", digest)
    assert not authorized(f"Bearer {KEY}x", digest) and not authorized(f"Basic {KEY}", digest)
    assert not authorized(None, digest) and not authorized("Bearer ", digest)


def test_read_api_key(tmp_path):
    assert read_api_key({API_KEY_ENV: f"  {KEY}\n"}, None) == KEY
    with pytest.raises(ConfigError, match=API_KEY_ENV):
        read_api_key({}, None)
    with pytest.raises(ConfigError, match="shorter"):
        read_api_key({API_KEY_ENV: "abc"}, None)
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    warnings: list[str] = []
    assert read_api_key({API_KEY_ENV: "other-key-value"}, str(path), warn=warnings.append) == KEY  # the file wins
    assert warnings == []
    os.chmod(path, 0o644)
    read_api_key({}, str(path), warn=warnings.append)
    assert warnings and "chmod 600" in warnings[0] and KEY not in warnings[0]
    with pytest.raises(ConfigError, match="no such file"):
        read_api_key({}, str(tmp_path / "missing"))


def test_deployment_options_replicas_autoscaling_and_placement():
    fixed = deployment_options(ServeSettings("m", "m", num_replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0} and "placement_group_bundles" not in fixed
    scaled = deployment_options(ServeSettings("m", "m", min_replicas=0, max_replicas=4, target_ongoing_requests=2,
                                              gpus_per_replica=2, max_replicas_per_node=1, cpus_per_replica=4))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 0, "initial_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 2}
    assert scaled["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 2.0}]
    assert scaled["placement_group_strategy"] == "STRICT_PACK" and scaled["max_replicas_per_node"] == 1
    assert scaled["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 2}
    for bad, field in ((dict(min_replicas=1), "max_replicas"), (dict(max_replicas=2, min_replicas=3), "min_replicas"),
                       (dict(engine="vllm2"), "engine"), (dict(num_replicas=0), "num_replicas"),
                       (dict(placement_strategy="ANY"), "placement_strategy")):
        with pytest.raises(ConfigError, match=field):
            deployment_options(ServeSettings("m", "m", **bad))


def test_one_replica_on_one_box_is_served_without_ray_serve_and_the_rest_by_it():
    one = ServeSettings("m", "m")
    assert choose_frontend(one, attached=False) == "direct"
    assert choose_frontend(one, attached=True) == "ray-serve"  # RAY_ADDRESS: deploy on that cluster
    assert choose_frontend(one, attached=False, detach=True) == "ray-serve"
    assert choose_frontend(ServeSettings("m", "m", num_replicas=2), attached=False) == "ray-serve"
    assert choose_frontend(ServeSettings("m", "m", max_replicas=3), attached=False) == "ray-serve"
    assert choose_frontend(ServeSettings("m", "m", frontend="ray-serve"), attached=False) == "ray-serve"
    with pytest.raises(ConfigError, match="frontend='direct' serves one replica"):
        ServeSettings("m", "m", frontend="direct", num_replicas=2).check()
    with pytest.raises(ConfigError, match="RAY_ADDRESS"):
        choose_frontend(ServeSettings("m", "m", frontend="direct"), attached=True)
    with pytest.raises(ConfigError, match="frontend='nginx'"):
        ServeSettings("m", "m", frontend="nginx").check()
    assert local_gpu_ids(2, "4,7,9") == [4, 7]
    with pytest.raises(ConfigError, match="gpus_per_replica=3"):
        local_gpu_ids(3, "0,1")


def test_the_direct_app_answers_under_its_route_prefix_and_a_taken_port_is_a_config_error(front):
    from fastapi.testclient import TestClient

    f, _ = front
    client = TestClient(mounted(build_http_app(f, key_digest(KEY)), "/api/"))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/api/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
    assert client.get("/v1/models", headers=auth).status_code == 404
    taken = bind("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError, match="pick another --port"):
            bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
