"""raygym serve with images (OpenAI ``image_url`` parts, data URLs only) for a vision-language checkpoint.

Fast tests: the front's ``/generate`` payload (widened ``input_ids`` + ``image_data``) and the 400s, driven by the
real ``openai`` client over the real HTTP app in-process (a recording engine behind it). The slow test serves
``builtin:tiny-qwen2.5-vl`` with the one-box server (:func:`raygym.serve.direct.run_direct`: raygym's engine server
behind uvicorn) and checks the ``openai`` client's greedy answers against the engine's own ``/generate`` for the
same widened ``input_ids`` and ``image_data``."""

from __future__ import annotations

import base64
import io
import socket
import threading

import openai
import pytest
from PIL import Image

from raygym.builtin import build_tokenizer
from raygym.builtin.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    build_image_processor,
    build_vlm_tokenizer,
    image_token_id,
)
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.serve.front import OpenAIFront
from raygym.serve.http import build_http_app, key_digest
from raygym.serve.images import ChatImages
from raygym.serve.protocol import ChatCompletionRequest
from raygym.vision.dataset import MAX_IMAGES_PER_SAMPLE
from raygym.vision.images import encode_image
from raygym.vision.tokens import expand_image_pads
from tests.vision_reference import MERGE, RED, WIDE

KEY = "serve-images-key-0123456789"
MODEL = "tiny-vl"


def jpeg_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def widened(tok, processor, text: str, images: list[Image.Image]) -> list[int]:
    """What the front must send: ``text`` (placeholders where the images go) through the chat template,
    tokenized, each image's pad widened by the image processor's grid."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(rendered, add_special_tokens=False)
    grids = processor(images=images)["image_grid_thw"].tolist()
    return expand_image_pads(ids, image_token=image_token_id(tok), grids=grids, merge=MERGE)


class RecordingEngine:
    """Answers every row with one token (the prompt's last) and records the requests as sent."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: list[GenerateRequest] = []

    def _answers(self, request: GenerateRequest) -> list[GenerateResponse]:
        self.requests.append(request)
        return [GenerateResponse.model_validate({
            "text": self.tokenizer.decode(ids[-1:]), "output_ids": ids[-1:], "index": row,
            "meta_info": {"id": f"r{row}", "prompt_tokens": len(ids), "completion_tokens": 1,
                          "output_token_logprobs": [[-0.25, ids[-1], None]],
                          "finish_reason": {"type": "length", "length": 1}}})
            for row, ids in enumerate(request.input_ids)]

    async def generate(self, request: GenerateRequest):
        return self._answers(request)

    async def generate_stream(self, request: GenerateRequest):
        for answer in self._answers(request):
            yield answer


@pytest.fixture
def vlm_front():
    tok = build_vlm_tokenizer()
    engine = RecordingEngine(tok)
    processor = build_image_processor()
    return OpenAIFront(tok, engine, MODEL, images=ChatImages(tok, processor)), engine, processor


def openai_client(front: OpenAIFront) -> openai.OpenAI:
    """The ``openai`` client over the real HTTP app, in this process (no socket)."""
    from fastapi.testclient import TestClient

    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, max_retries=0,
                         http_client=TestClient(build_http_app(front, key_digest(KEY))))


def test_image_parts_become_widened_pads_and_image_data(vlm_front):
    front, engine, processor = vlm_front
    tok = front.tokenizer
    client = openai_client(front)
    messages = user(image_part(encode_image(WIDE)), "n=", image_part(jpeg_url(RED)), "count:")
    answer = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=1, logprobs=True)
    sent = engine.requests[-1]
    expected = widened(tok, processor, IMAGE_PLACEHOLDER + "n=" + IMAGE_PLACEHOLDER + "count:",
                       [WIDE, Image.open(io.BytesIO(base64.b64decode(jpeg_url(RED).split(",", 1)[1]))).convert("RGB")])
    assert sent.input_ids == [expected, expected]  # n=2: one row per choice, each with the images
    assert expected.count(image_token_id(tok)) == 6 + 4
    # PNG data URLs, re-encoded from the decoded pixels (the JPEG too): the engine gets one form
    assert sent.image_data[0][0] == encode_image(WIDE) and sent.image_data[0][1].startswith("data:image/png;base64,")
    assert sent.image_data == [sent.image_data[0]] * 2 and len(sent.image_data[0]) == 2
    assert answer.usage.prompt_tokens == len(expected) and len(answer.choices) == 2
    # streamed: the same payload
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, stream=True))
    assert engine.requests[-1].input_ids == [expected] and engine.requests[-1].image_data == [sent.image_data[0]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content


def test_text_requests_are_unchanged_on_a_vision_model(vlm_front):
    front, engine, _ = vlm_front
    client = openai_client(front)
    client.chat.completions.create(model=MODEL, messages=user("a", "b"), max_tokens=1)
    sent = engine.requests[-1]
    plain = front.tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False,
                                                add_generation_prompt=True)
    assert sent.input_ids == [front.encode(plain)] and sent.image_data is None
    assert "image_data" not in sent.model_dump(exclude_unset=True)
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": user(image_part("data:x"), "hi")})
    assert request.has_images() and request.messages[0].text() == "hi"


def bad_request(client: openai.OpenAI, messages: list[dict]) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    return info.value.message


def test_bad_images_are_400s_and_nothing_is_fetched(vlm_front, monkeypatch, tmp_path):
    import urllib.request

    import fsspec

    def no_fetch(*args, **kwargs):
        raise AssertionError(f"the server must not fetch images: {args}")

    monkeypatch.setattr(fsspec, "open", no_fetch)
    monkeypatch.setattr(fsspec.core, "url_to_fs", no_fetch)
    monkeypatch.setattr(urllib.request, "urlopen", no_fetch)
    front, engine, _ = vlm_front
    client = openai_client(front)
    local = tmp_path / "a.png"
    RED.save(local)
    for url in ("http://169.254.169.254/latest/meta-data/x.png", "https://example.com/cat.png", f"file://{local}",
                str(local), "DATA.png", "s3://bucket/a.png"):
        message = bad_request(client, user(image_part(url), "x"))
        assert "only data URLs are served" in message and "messages[0].content[0].image_url" in message, message
    junk = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    assert "not a readable image" in bad_request(client, user("x", image_part(junk)))
    assert "messages[0].content[1].image_url" in bad_request(client, user("x", image_part(junk)))
    assert "not valid base64" in bad_request(client, user(image_part("data:image/png;base64,@@@@"), "x"))
    assert "data:image/<type>;base64" in bad_request(client, user(image_part("data:text/plain;base64,AAAA"), "x"))
    assert "data:image/<type>;base64" in bad_request(client, user(image_part("data:image/png,rawbytes"), "x"))
    too_many = user(*[image_part(encode_image(RED))] * (MAX_IMAGES_PER_SAMPLE + 1), "x")
    assert f"more than the {MAX_IMAGES_PER_SAMPLE} a request may have" in bad_request(client, too_many)
    assert "<|image_pad|>" in bad_request(client, user(image_part(encode_image(RED)), "<|image_pad|>"))
    message = bad_request(client, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert "messages.0.content" in message, message
    assert engine.requests == []  # nothing reached the engine
    with pytest.raises(openai.NotFoundError):  # the model is checked before any image is decoded
        client.chat.completions.create(model="other", messages=user(image_part("https://x/y.png")), max_tokens=1)


def test_images_to_a_text_only_model_are_a_400_naming_the_model():
    tok = build_tokenizer()
    engine = RecordingEngine(tok)
    client = openai_client(OpenAIFront(tok, engine, MODEL))
    message = bad_request(client, user(image_part(encode_image(RED)), "count:"))
    assert f"the model `{MODEL}` is a text-only model" in message, message
    assert engine.requests == []
    client.chat.completions.create(model=MODEL, messages=user("count:"), max_tokens=1)  # text still served
    assert engine.requests[-1].image_data is None


# ── the real engine ────────────────────────────────────────────────────────────────────────────────


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_vlm(tmp_path_factory):
    """``raygym serve`` of builtin:tiny-qwen2.5-vl on this box (run_direct on a thread), its engine and model dir."""
    import raygym.serve.direct as direct
    from raygym.builtin.tiny_vlm import materialize_vlm
    from raygym.serve.settings import ServeSettings

    model_dir = materialize_vlm(tmp_path_factory.mktemp("serve-vlm"))
    settings = ServeSettings(model_dir, MODEL, engine="raygym", gpus_per_replica=0,
                             engine_settings={"rollout_max_response_len": 16})
    started: dict = {}
    real = direct.start_engine_front

    def keep(*args, **kwargs):
        started["engine"], started["front"] = real(*args, **kwargs)
        return started["engine"], started["front"]

    ready, stop, failed = threading.Event(), threading.Event(), []

    def serve() -> None:
        try:
            direct.run_direct(settings, KEY, port=_free_port(), say=lambda _: None, stop=stop,
                              on_ready=lambda endpoint: (started.__setitem__("url", endpoint.url), ready.set()))
        except BaseException as exc:  # noqa: BLE001 - reported by the fixture
            failed.append(exc)
            ready.set()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct, "start_engine_front", keep)
        thread = threading.Thread(target=serve, name="serve-vlm", daemon=True)
        thread.start()
        assert ready.wait(240), "raygym serve did not start in 240 s"
    try:
        assert not failed, failed
        yield started, model_dir
    finally:
        stop.set()
        thread.join(60)


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0}


@pytest.mark.slow  # starts raygym's engine server
def test_the_openai_client_gets_what_the_engine_gives_for_the_widened_prompt(served_vlm):
    from transformers import AutoImageProcessor, AutoTokenizer

    started, model_dir = served_vlm
    engine = started["engine"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    assert processor.merge_size == MERGE
    client = openai.OpenAI(base_url=started["url"], api_key=KEY, max_retries=0)

    answers = {}
    for name, image in (("wide", WIDE), ("red", RED)):
        messages = user(image_part(jpeg_url(image) if name == "red" else encode_image(image)), "count:")
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=GREEDY["max_new_tokens"],
                                             temperature=0, logprobs=True)
        decoded = image if name == "wide" else Image.open(io.BytesIO(base64.b64decode(
            jpeg_url(image).split(",", 1)[1]))).convert("RGB")
        ids = widened(tok, processor, IMAGE_PLACEHOLDER + "count:", [decoded])
        want = engine.generate(GenerateRequest(input_ids=[ids], image_data=[[encode_image(decoded)]],
                                               sampling_params=[dict(GREEDY)], return_logprob=True))
        want = want[0] if isinstance(want, list) else want
        want_ids, want_logprobs = want.tokens_and_logprobs()
        choice = got.choices[0]
        assert choice.message.content == want.text
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(want_logprobs, abs=1e-5)
        assert len(choice.logprobs.content) == len(want_ids) and got.usage.prompt_tokens == len(ids)
        assert choice.finish_reason == ("length" if want.finish_type == "length" else "stop")
        answers[name] = (choice.message.content, [t.logprob for t in choice.logprobs.content])
        if name == "wide":  # streamed, the same answer
            stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, temperature=0,
                                                    max_tokens=GREEDY["max_new_tokens"])
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    text_wide, lp_wide = answers["wide"]
    text_red, lp_red = answers["red"]
    assert text_wide != text_red or lp_wide[0] != pytest.approx(lp_red[0], abs=1e-4), answers  # the image matters
    with pytest.raises(openai.BadRequestError, match="only data URLs are served"):
        client.chat.completions.create(model=MODEL, messages=user(image_part("http://127.0.0.1:1/a.png"), "x"))


def test_chat_images_for_checkpoint_is_none_for_a_text_model(tmp_path):
    from raygym.builtin import TINY_MODEL, materialize_model

    path = materialize_model(TINY_MODEL, tmp_path)
    assert ChatImages.for_checkpoint(path, build_tokenizer()) is None
