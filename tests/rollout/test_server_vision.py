"""raygym's server on a vision-language model (the builtin tiny Qwen2.5-VL): the generation engine with images
against HF's own forward pass, continuous batching with per-row M-RoPE deltas, and ``/generate``'s
``image_data`` over real HTTP (the server's aiohttp app on 127.0.0.1, in this process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer
from PIL import Image
from transformers import LlavaConfig

from raygym.builtin import build_tiny_model
from raygym.builtin.tiny_vlm import (
    TINY_VLM,
    build_image_processor,
    build_tiny_vlm,
    image_token_id,
    materialize_vlm,
)
from raygym.engine_api.client import EngineClient, EngineHTTPError
from raygym.engine_api.protocol import Endpoint, GenerateRequest, UpdateWeightsFromTensor
from raygym.engines.raygym_server.generation import GenerationEngine, GenerationRequest, SamplingParams
from raygym.engines.raygym_server.server import InferenceServer, load_image_processor, load_model
from raygym.engines.raygym_server.vision_inputs import VisionSupport
from raygym.vision.images import encode_image
from raygym.weightsync.tensor_pickle import dumps_named_tensors
from tests.vision_reference import DARK, RED, WIDE, hf_log_softmax, hf_logprobs, vlm_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the in-process reference forwards


@pytest.fixture(scope="module")
def vlm():
    model, tok = build_tiny_vlm(0)
    return model.eval(), tok, build_image_processor()


def hf_decode_log_softmax(model: Any, tok: Any, proc: Any, prompt: list[int], output: list[int],
                          images: list[Image.Image]) -> torch.Tensor:
    """HF's log_softmax (:func:`tests.vision_reference.hf_log_softmax`: the images' pixels and the prompt's
    ``mrope_positions``, a generated ``<|image_pad|>`` as text) at every position from the last prompt token on:
    [len(output) + 1, vocab]."""
    return hf_log_softmax(model, tok, proc, prompt, output, images, after_last=True)[len(prompt) - 1:]


def new_engine(model: Any, tok: Any, proc: Any, **kwargs: Any) -> GenerationEngine:
    engine = GenerationEngine(model, eos_token_ids=[tok.eos_token_id], tokenizer=tok, image_processor=proc,
                              **kwargs)
    engine.start()
    return engine


def request(engine: GenerationEngine, rid: str, prompt: list[int], images: list[Image.Image], max_new_tokens: int,
            **kwargs: Any) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                                         ignore_eos=True),
                             images=engine.prepare_images(prompt, images), **kwargs)


def run_all(engine: GenerationEngine, requests: list[GenerationRequest]) -> None:
    engine.submit_all(requests)
    for r in requests:
        assert r.wait(120), f"request {r.rid} did not finish"
        assert r.finish_reason is not None and r.finish_reason["type"] == "length", r.finish_reason


def assert_same(got: GenerationRequest, want: GenerationRequest) -> None:
    assert got.output_ids == want.output_ids, got.rid
    torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                               atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize(("prefix", "images", "generates_pad"), [("img:", [RED], False), ("img:", [WIDE, RED], False),
                                                                ("look:", [RED], True)],
                         ids=["one-image", "two-images", "generated-image-pad"])
def test_greedy_generation_with_images_matches_hf_forward(vlm, prefix, images, generates_pad):
    model, tok, proc = vlm
    parts = [prefix, *[" and " for _ in images[1:]], " count="]
    prompt = vlm_prompt(tok, proc, parts, images)
    engine = new_engine(model, tok, proc)
    try:
        r = request(engine, "a", prompt, images, 10)
        run_all(engine, [r])
        # without a generated pad, the reference is HF's forward as it is (it places the images itself); with one
        # (a random model samples anything) the reference embeds it as the text token it is
        assert (image_token_id(tok) in r.output_ids) == generates_pad, r.output_ids
        expected = hf_decode_log_softmax(model, tok, proc, prompt, r.output_ids, images)
        assert r.output_ids == expected[:-1].argmax(-1).tolist()
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs),
            expected[:-1].gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1), atol=1e-4, rtol=1e-4)
        # input log-probs (SGLang's input_token_logprobs) are the VLM's with its images too
        torch.testing.assert_close(torch.tensor(engine.score(prompt, r.images)),
                                   hf_logprobs(model, tok, proc, prompt, [], images), atol=1e-4, rtol=1e-4)
    finally:
        engine.stop()


def test_a_batch_of_image_and_text_rows_matches_each_solo_run(vlm):
    model, tok, proc = vlm
    rows = [  # different images, deltas and lengths; rows leave the batch at different steps
        (vlm_prompt(tok, proc, ["a:", " n="], [RED]), [RED], 4),
        (vlm_prompt(tok, proc, ["wide picture:", "?"], [WIDE]), [WIDE], 9),
        (tok.encode("next:12="), [], 6),
        (vlm_prompt(tok, proc, ["x", "y", "z="], [DARK, WIDE]), [DARK, WIDE], 7),
    ]
    engine = new_engine(model, tok, proc, max_running_requests=8)
    try:
        solo = [request(engine, f"solo{i}", p, ims, n) for i, (p, ims, n) in enumerate(rows)]
        for r in solo:
            run_all(engine, [r])
        batches = engine.stats.batches
        together = [request(engine, f"batch{i}", p, ims, n) for i, (p, ims, n) in enumerate(rows)]
        run_all(engine, together)
        assert engine.stats.batches == batches + 1  # one batch, prefilled together
        for got, want in zip(together, solo, strict=True):
            assert_same(got, want)
    finally:
        engine.stop()


@pytest.mark.parametrize("first_has_image", [True, False], ids=["image-batch", "text-batch"])
def test_rows_joining_mid_decode_keep_their_own_deltas(vlm, first_has_image):
    model, tok, proc = vlm
    long_images = [WIDE] if first_has_image else []
    long_prompt = vlm_prompt(tok, proc, ["long:", "="], long_images) if first_has_image else tok.encode("long text=")
    joiners = [
        (vlm_prompt(tok, proc, ["b:", "="], [RED]), [RED], 6),
        (tok.encode("7+8="), [], 5),
        (vlm_prompt(tok, proc, ["c", "="], [DARK]), [DARK], 3),
    ]
    engine = new_engine(model, tok, proc, batch_wait_s=0.0, max_running_requests=8)
    try:
        solo_long = request(engine, "solo-long", long_prompt, long_images, 24)
        run_all(engine, [solo_long])
        solo = [request(engine, f"solo{i}", p, ims, n) for i, (p, ims, n) in enumerate(joiners)]
        for r in solo:
            run_all(engine, [r])
        late = [request(engine, f"late{i}", p, ims, n) for i, (p, ims, n) in enumerate(joiners)]
        submitted = threading.Event()

        def submit_late(r: GenerationRequest) -> None:  # from the worker, after the long row's 3rd token
            if len(r.output_ids) == 3 and not submitted.is_set():
                submitted.set()
                engine.submit_all(late)

        joined = engine.stats.joined
        long = request(engine, "long", long_prompt, long_images, 24, on_token=submit_late)
        run_all(engine, [long])
        for r in late:
            assert r.wait(120) and r.finish_reason["type"] == "length"
        assert submitted.is_set() and engine.stats.joined == joined + len(late)  # all joined the long row's batch
        assert_same(long, solo_long)
        for got, want in zip(late, solo, strict=True):
            assert_same(got, want)
    finally:
        engine.stop()


def test_a_retracted_image_row_is_re_prefilled_with_its_generated_tokens_as_text(vlm):
    """A row retracted mid-decode (pause mode ``retract``; a weight update's recompute is the same re-prefill)
    comes back as prompt + tokens so far: the image pad the model generated stays a token, and the result is the
    uninterrupted run's."""
    model, tok, proc = vlm
    prompt = vlm_prompt(tok, proc, ["look:", " count="], [RED])
    engine = new_engine(model, tok, proc, batch_wait_s=0.0)
    try:
        solo = request(engine, "solo", prompt, [RED], 12)
        run_all(engine, [solo])
        pad = image_token_id(tok)
        assert pad in solo.output_ids[:9], solo.output_ids  # this prompt makes the model generate an image pad
        at = solo.output_ids.index(pad) + 2
        paused, parks = threading.Event(), []

        def retract(r: GenerationRequest) -> None:  # from the worker, once the pad is in the row's tokens
            if len(r.output_ids) == at and not paused.is_set():
                parks.append(engine.stats.parks)
                engine.pause("retract")
                paused.set()

        batches = engine.stats.batches
        r = request(engine, "r", prompt, [RED], 12, on_token=retract)
        engine.submit(r)
        assert paused.wait(60) and engine.wait_parked(after=parks[0], timeout=60)
        assert not r.done and len(r.output_ids) == at
        engine.resume()
        assert r.wait(60) and r.finish_reason == {"type": "length", "length": 12}
        assert engine.stats.batches == batches + 2  # prefilled twice: the prompt, then prompt + tokens so far
        assert_same(r, solo)
        expected = hf_decode_log_softmax(model, tok, proc, prompt, r.output_ids, [RED])
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs),
            expected[:-1].gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1), atol=1e-4, rtol=1e-4)
    finally:
        engine.stop()


def test_the_image_changes_the_distribution(vlm):
    model, tok, proc = vlm
    engine = new_engine(model, tok, proc)
    try:
        prompts = {name: vlm_prompt(tok, proc, ["what:", " is it?"], [image]) for name, image in
                   (("red", RED), ("dark", DARK))}
        assert prompts["red"] == prompts["dark"]  # same size: the same tokens, only the pixels differ
        prompt = prompts["red"]
        answers = {name: request(engine, name, prompt, [image], 1) for name, image in
                   (("red", RED), ("dark", DARK), ("red-again", RED))}
        run_all(engine, list(answers.values()))
        first = {name: hf_decode_log_softmax(model, tok, proc, prompt, r.output_ids, [image])[0]
                 for (name, r), image in zip(answers.items(), (RED, DARK, RED), strict=True)}
        assert (first["red"] - first["dark"]).abs().max() > 1e-3  # the distributions differ
        torch.testing.assert_close(first["red"], first["red-again"])
        for r in answers.values():  # and the engine's log-prob is each image's own
            assert r.output_logprobs[0] == pytest.approx(first[r.rid][r.output_ids[0]].item(), abs=1e-4)
        # the prompt's own log-probs: the same before the image, different after it
        red, dark = (engine.score(prompt, answers[k].images) for k in ("red", "dark"))
        start = prompt.index(image_token_id(tok))
        assert red[:start - 1] == pytest.approx(dark[:start - 1], abs=1e-6)
        assert max(abs(a - b) for a, b in zip(red[start:], dark[start:], strict=True)) > 1e-3
    finally:
        engine.stop()


def test_prepare_images_refuses_what_cannot_be_served(vlm):
    model, tok, proc = vlm
    engine = GenerationEngine(model, eos_token_ids=[1], image_processor=proc)  # not started: nothing runs
    prompt = vlm_prompt(tok, proc, ["a:", "="], [RED])
    with pytest.raises(ValueError, match=r"has 4 image token\(s\).*2 image\(s\) need 8 \(4 \+ 4:"):
        engine.prepare_images(prompt, [RED, RED])
    with pytest.raises(ValueError, match=r"has 4 image token\(s\).*but no image_data"):
        engine.prepare_images(prompt, [])
    assert engine.prepare_images(tok.encode("text="), []) is None
    text_model, _ = build_tiny_model(0)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is a text-only model"):
        GenerationEngine(text_model).prepare_images([3, 4], [RED])
    no_processor = GenerationEngine(model)
    with pytest.raises(ValueError, match="no image processor"):
        no_processor.prepare_images(prompt, [RED])
    # a vision-language model of a family whose images this server does not place
    llava = LlavaConfig(image_token_index=5)
    llava.name_or_path = "some/llava"
    other = SimpleNamespace(config=llava)
    support = VisionSupport.from_model(other, proc)
    assert support is not None and support.unsupported is not None
    with pytest.raises(ValueError, match=r"some/llava \(model_type 'llava'\) is a vision-language model"):
        support.prepare([5, 5, 5, 5], [RED])


# ----------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return materialize_vlm(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def http_server(vlm_path, tmp_path_factory):
    """The server as ``serve()`` builds it for ``--model-path <the tiny VLM>`` (load_model, its image processor)."""
    model, tok, local = load_model(vlm_path, torch.device("cpu"), "auto")
    engine = GenerationEngine(model, eos_token_ids=[1], tokenizer=tok, image_processor=load_image_processor(model, local))
    server = InferenceServer(engine, model_path=local, tokenizer=tok, weight_version="0",
                             weight_sources=(str(tmp_path_factory.getbasetemp()),))
    engine.start()
    yield server
    server.weights.receiver.close()
    engine.stop()


def over_http(server: InferenceServer, fn: Callable[[EngineClient], Awaitable[Any]]) -> Any:
    """``fn(client)`` against ``server``'s app listening on 127.0.0.1."""

    async def go() -> Any:
        site = TestServer(server.app(), host="127.0.0.1")
        await site.start_server()
        try:
            async with EngineClient(str(site.make_url("")).rstrip("/"), timeout=120) as client:
                return await fn(client)
        finally:
            await site.close()

    return asyncio.run(go())


def generate(server: InferenceServer, body: dict[str, Any]) -> Any:
    answer = over_http(server, lambda c: c.generate(GenerateRequest.model_validate(body)))
    return [a.model_dump() for a in answer] if isinstance(answer, list) else answer.model_dump()


def http_error(server: InferenceServer, body: dict[str, Any]) -> tuple[int, str]:
    with pytest.raises(EngineHTTPError) as caught:
        generate(server, body)
    return caught.value.status, caught.value.message()


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_load_model_serves_the_builtin_vlm_with_its_processor(vlm_path):
    model, tok, path = load_model(TINY_VLM, torch.device("cpu"), "auto")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and model.dtype == torch.float32
    assert type(load_image_processor(model, path)).__name__.startswith("Qwen2VLImageProcessor")
    reference, _ = build_tiny_vlm(0)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)
    text_model, _, text_path = load_model("builtin:tiny-qwen3", torch.device("cpu"), "auto")
    assert load_image_processor(text_model, text_path) is None


def test_generate_with_image_data_matches_hf_and_batches_with_text(http_server, vlm):
    model, tok, proc = vlm
    info = over_http(http_server, lambda c: c.get_model_info())
    assert info.has_image_understanding
    prompt = vlm_prompt(tok, proc, ["look:", " n="], [WIDE])
    one = generate(http_server, {"input_ids": prompt, "image_data": encode_image(WIDE), "return_logprob": True,
                                 "logprob_start_len": 0, "sampling_params": GREEDY})
    expected = hf_decode_log_softmax(model, tok, proc, prompt, one["output_ids"], [WIDE])
    assert one["output_ids"] == expected[:-1].argmax(-1).tolist()
    meta = one["meta_info"]
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    torch.testing.assert_close(got, expected[:-1].gather(-1, torch.tensor(one["output_ids"])[:, None]).squeeze(-1),
                               atol=1e-4, rtol=1e-4)
    inputs = meta["input_token_logprobs"]
    assert inputs[0][0] is None and [t for _, t, _ in inputs] == prompt
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in inputs[1:]]),
                               hf_logprobs(model, tok, proc, prompt, [], [WIDE]), atol=1e-4, rtol=1e-4)
    # a batch: an image prompt, a text prompt and a two-image prompt, each as it runs alone
    text = tok.encode("next:4=")
    two = vlm_prompt(tok, proc, ["p", "q", "="], [RED, DARK])
    batch = generate(http_server, {
        "input_ids": [prompt, text, two], "sampling_params": GREEDY, "return_logprob": True,
        "image_data": [[encode_image(WIDE)], [], [encode_image(RED), encode_image(DARK)]]})
    alone = [one, generate(http_server, {"input_ids": text, "sampling_params": GREEDY, "return_logprob": True}),
             generate(http_server, {"input_ids": two, "image_data": [encode_image(RED), encode_image(DARK)],
                                    "sampling_params": GREEDY, "return_logprob": True})]
    for got_answer, want in zip(batch, alone, strict=True):
        assert got_answer["output_ids"] == want["output_ids"]
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got_answer["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor([lp for lp, _, _ in want["meta_info"]["output_token_logprobs"]]),
                                   atol=1e-4, rtol=1e-4)
    # n samples of one image prompt share its images
    samples = generate(http_server, {"input_ids": prompt, "image_data": encode_image(WIDE),
                                     "sampling_params": {**GREEDY, "n": 2}})
    assert [s["output_ids"] for s in samples] == [one["output_ids"]] * 2


def test_generate_refuses_bad_image_requests_with_400(http_server, vlm):
    model, tok, proc = vlm
    prompt = vlm_prompt(tok, proc, ["look:", " n="], [RED])  # 4 image tokens
    status, message = http_error(http_server, {"input_ids": prompt, "image_data": encode_image(WIDE),
                                               "sampling_params": GREEDY})
    assert status == 400 and "has 4 image token(s)" in message and "need 6" in message, message
    status, message = http_error(http_server, {"input_ids": prompt, "image_data": "data:image/png;base64,AAAA",
                                               "sampling_params": GREEDY})
    assert status == 400 and "image 0" in message and "not a readable image" in message, message
    status, message = http_error(http_server, {"input_ids": prompt, "image_data": "not an image at all",
                                               "sampling_params": GREEDY})
    assert status == 400 and "not base64 image data" in message, message
    status, message = http_error(http_server, {"input_ids": prompt, "sampling_params": GREEDY})
    assert status == 400 and "no image_data" in message, message
    status, message = http_error(http_server, {"input_ids": [prompt, tok.encode("a")], "sampling_params": GREEDY,
                                               "image_data": [encode_image(RED)]})
    assert status == 400 and "1 for 2 prompts" in message, message
    status, message = http_error(http_server, {"input_ids": [tok.encode("a"), prompt], "sampling_params": GREEDY,
                                               "image_data": [[], [encode_image(WIDE)]]})
    assert status == 400 and message.startswith("prompt 1: ") and "need 6" in message, message
    assert http_server.engine.pending() == 0  # nothing was queued


def test_image_data_on_a_text_model_is_a_400_naming_the_model(tmp_path):
    from raygym.builtin import TINY_MODEL, materialize_model

    path = materialize_model(TINY_MODEL, tmp_path)
    model, tok, local = load_model(path, torch.device("cpu"), "auto")
    engine = GenerationEngine(model, eos_token_ids=[1], tokenizer=tok, image_processor=load_image_processor(model, local))
    server = InferenceServer(engine, model_path=local, tokenizer=tok)
    engine.start()
    try:
        status, message = http_error(server, {"input_ids": [3, 4, 5], "image_data": encode_image(RED),
                                              "sampling_params": GREEDY})
        assert status == 400 and f"the model {local} is a text-only model" in message, message
        assert not over_http(server, lambda c: c.get_model_info()).has_image_understanding
        answer = generate(server, {"input_ids": [3, 4, 5], "sampling_params": GREEDY})  # text still works
        assert len(answer["output_ids"]) == 6
    finally:
        server.weights.receiver.close()
        engine.stop()


def test_weight_updates_by_in_memory_and_checkpoint_names(http_server, tmp_path_factory):
    engine = http_server.engine
    other, _ = build_tiny_vlm(1)
    served = engine.model.state_dict()
    original = {n: t.clone() for n, t in served.items()}
    assert any(n.startswith("model.language_model.") for n in served) and any(n.startswith("model.visual.") for n in served)
    try:
        # a saved checkpoint (model.layers.*, visual.*, lm_head.weight) from disk
        path = materialize_vlm(tmp_path_factory.mktemp("vlm-seed1"), seed=1)
        result = over_http(http_server, lambda c: c.update_weights_from_disk(path, weight_version="1"))
        assert result.success, result.message
        for name, tensor in other.state_dict().items():
            torch.testing.assert_close(served[name], tensor, rtol=0, atol=0)
        # the trainer's in-memory names (Qwen2_5_VLForConditionalGeneration.state_dict())
        named = [(n, t) for n, t in original.items() if n.startswith(("model.language_model.layers.0.", "model.visual.",
                                                                       "lm_head."))]
        body = UpdateWeightsFromTensor(serialized_named_tensors=[dumps_named_tensors(named)], weight_version="2")
        answer = over_http(http_server, lambda c: c.send_json(Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, body))
        assert answer["success"], answer
        for name, _ in named:
            torch.testing.assert_close(served[name], original[name], rtol=0, atol=0)
        layer1 = "model.language_model.layers.1.mlp.up_proj.weight"
        torch.testing.assert_close(served[layer1], other.state_dict()[layer1], rtol=0, atol=0)  # untouched
        # checkpoint names by tensor, and reads by either name
        ckpt = [("model.layers.1.mlp.up_proj.weight", original[layer1])]
        body = UpdateWeightsFromTensor(serialized_named_tensors=[dumps_named_tensors(ckpt)], weight_version="3")
        answer = over_http(http_server, lambda c: c.send_json(Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, body))
        assert answer["success"], answer
        torch.testing.assert_close(served[layer1], original[layer1], rtol=0, atol=0)
        sums = over_http(http_server, lambda c: c.weights_checksum([layer1, "model.layers.1.mlp.up_proj.weight",
                                                                   "visual.merger.ln_q.weight"]))
        assert sums.checksums[layer1] == sums.checksums["model.layers.1.mlp.up_proj.weight"]
        assert set(sums.checksums) == {layer1, "model.layers.1.mlp.up_proj.weight", "visual.merger.ln_q.weight"}
    finally:
        body = UpdateWeightsFromTensor(serialized_named_tensors=[dumps_named_tensors(list(original.items()))], weight_version="0")
        answer = over_http(http_server, lambda c: c.send_json(Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, body))
        assert answer["success"], answer
