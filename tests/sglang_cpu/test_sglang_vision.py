"""Images on stock, unpatched SGLang (its CPU backend, its own interpreter) through raygym, on the builtin tiny
Qwen2.5-VL: raygym's widened prompts go to SGLang with one pad per image (:mod:`raygym.engines.sglang_images`),
SGLang's greedy answers and log-probs are HF's forward pass of the same model and images (system python), other
images give other log-probs, a rollout step's batch of image prompts is answered whole, a request SGLang cannot be
given is refused before it is sent, and a verified weight sync of a changed state dict in the trainer's in-memory
names (``model.language_model.*``, ``model.visual.*``) makes SGLang answer with the new vision tower and language
model, for an image it had embedded before the sync too (SGLang's vision-feature cache is off).

The first test needs no SGLang: the conversions and the command line are pure."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from raygym.builtin import TINY_MODEL, materialize_model
from raygym.builtin.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    build_image_processor,
    build_tiny_vlm,
    image_token_id,
    materialize_vlm,
)
from raygym.config import Recipe
from raygym.engine_api.auth import use_engine_api_key
from raygym.engine_api.client import EngineClient, EngineHTTPError
from raygym.engine_api.protocol import Endpoint, GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.engines.launch.sglang import build_sglang_argv
from raygym.engines.sglang_images import (
    SGLangImageClient,
    checkpoint_image_tokens,
    client_factory,
    engine_client,
    sglang_request,
    split_prompts,
    tokenizer_image_tokens,
)
from raygym.errors import WeightSyncError
from raygym.vision.images import encode_image
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.probe_image import image_probe
from raygym.weightsync.sender import RankWeightSync
from raygym.weightsync.vlm_names import names_for_engine
from tests.vision_reference import (
    DARK,
    RED,
    WIDE,
    ReferenceProbe,
    hf_log_softmax,
    hf_output_logprobs,
    hf_text_argmax,
    picture,
    vlm_prompt,
)
from tests.weightsync.local_trainer import LocalTrainer

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.sglang_cpu, pytest.mark.timeout(1200)]
API_KEY = "sglang-vision-test-key"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
# SGLang serves the float32 checkpoint in float16 and runs its own kernels: its log-probs here are within 5e-4 of HF's
# float32 forward (test_sglang_engine.py allows 0.05 on the text model). Tighter than that, so that what the vision
# tower changes shows: the checkpoint's tower under the new language model moves a log-prob by ~0.06.
TOL = 0.01
APART = 0.03  # log-probs that another image or other weights give differ from these by more than this somewhere


@pytest.fixture(scope="module")
def vlm():
    model, tok = build_tiny_vlm(0)
    return model.eval(), tok, build_image_processor()


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return materialize_vlm(tmp_path_factory.mktemp("sglang-vlm"))


def logprobs(answer: Any) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])


def assert_matches_hf(model: Any, tok: Any, proc: Any, prompt: list[int], images: list[Image.Image],
                      answer: Any) -> None:
    """SGLang's greedy tokens are HF's argmax, its log-probs of them HF's, for raygym's widened prompt."""
    out = answer["output_ids"]
    meta = answer["meta_info"]
    assert meta["prompt_tokens"] == len(prompt), (meta["prompt_tokens"], len(prompt))
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out and len(out) == GREEDY["max_new_tokens"]
    hf = hf_log_softmax(model, tok, proc, prompt, out, images)[len(prompt) - 1:]
    assert out == hf.argmax(-1).tolist()
    want = hf.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs(answer), want, atol=TOL, rtol=0)


# ----- without SGLang: the conversions and the command line -----


def test_widened_prompts_go_to_sglang_with_one_pad_per_image(vlm, vlm_path, tmp_path):
    _, tok, proc = vlm
    pad = image_token_id(tok)
    tokens = tokenizer_image_tokens(tok)
    assert tokens == checkpoint_image_tokens(vlm_path) and tokens is not None and tokens.pad == pad
    two = vlm_prompt(tok, proc, ["p", "q", "="], [RED, WIDE])
    assert two.count(pad) == 4 + 6
    text = tok.encode("a=")
    urls = [encode_image(RED), encode_image(WIDE)]
    batch = sglang_request(GenerateRequest(input_ids=[two, text], image_data=[urls, []]), tokens)
    assert batch.input_ids == [tok.encode(IMAGE_PLACEHOLDER.join("pq=")), text] and batch.image_data == [urls, []]
    one = sglang_request(GenerateRequest(input_ids=two, image_data=urls), tokens)
    assert one.input_ids == tok.encode(IMAGE_PLACEHOLDER.join("pq="))
    assert sglang_request(GenerateRequest(input_ids=text), tokens).input_ids == text  # text: as it was
    with pytest.raises(ValueError, match=r"prompt 0: the prompt holds 3 run\(s\) of image pad tokens for its 2"):
        sglang_request(GenerateRequest(input_ids=two + [5, pad], image_data=urls), tokens)  # a sampled pad
    with pytest.raises(ValueError, match="image 1's pad tokens .* not between"):
        sglang_request(GenerateRequest(input_ids=two[:-4] + [pad] + text, image_data=urls), tokens)
    # a batch with images goes one request per prompt (SGLang's batched tokenization of images races its answers)
    parts = split_prompts(GenerateRequest(input_ids=[two, text], image_data=[urls, []], rid=["a", "b"],
                                          sampling_params=[{"sampling_seed": 1}, {"sampling_seed": 2}],
                                          return_logprob=True))
    assert parts is not None and [(r.input_ids, r.image_data, r.rid, r.sampling_params) for r in parts] == [
        (two, urls, "a", {"sampling_seed": 1}), (text, None, "b", {"sampling_seed": 2})]
    assert all(r.return_logprob is True for r in parts)
    assert split_prompts(GenerateRequest(input_ids=[two], image_data=[urls])) is None  # a batch of one
    assert split_prompts(GenerateRequest(input_ids=[text, text])) is None  # no images
    # stock SGLang on a VLM gets the converting client; other kinds and text models plain ones
    text_path = materialize_model(TINY_MODEL, tmp_path)
    assert checkpoint_image_tokens(text_path) is None
    assert tokenizer_image_tokens(AutoTokenizer.from_pretrained(text_path)) is None
    assert isinstance(engine_client("sglang", "http://127.0.0.1:1", image_tokens=tokens), SGLangImageClient)
    for kind, found in (("sglang", None), ("raygym", tokens), ("vllm", tokens)):
        client = engine_client(kind, "http://127.0.0.1:1", image_tokens=found)
        assert type(client) is EngineClient
        assert client_factory(kind, found, None) is None
    made = client_factory("sglang", tokens, 30.0)("http://127.0.0.1:2")
    assert isinstance(made, SGLangImageClient) and made.timeout == 30.0
    # the builtin VLM's video token is its image pad: SGLang is told another one, outside the vocabulary
    argv = build_sglang_argv(Recipe(), model_path=vlm_path, host="127.0.0.1", port=1, device="cpu")
    assert argv[argv.index("--json-model-override-args") + 1] == json.dumps({"video_token_id": len(tok)})
    assert "--json-model-override-args" not in build_sglang_argv(Recipe(), model_path=text_path, host="127.0.0.1",
                                                                 port=1, device="cpu")
    # weights: SGLang loads a VLM by its checkpoint's names
    names = list(build_tiny_vlm(0)[0].state_dict())
    mapped = [n for n, _ in names_for_engine(((n, None) for n in names), "sglang")]
    assert "model.layers.0.self_attn.q_proj.weight" in mapped and "visual.blocks.0.attn.qkv.weight" in mapped
    assert "lm_head.weight" in mapped and not any(n.startswith(("model.language_model.", "model.visual.")) for n in mapped)
    assert [n for n, _ in names_for_engine(((n, None) for n in names), "raygym")] == names


# ----- on SGLang -----


def recipe(python: str, **over: Any) -> Recipe:
    fields: dict[str, Any] = dict(
        rollout_engine="sglang", rollout_engine_python=python, colocate=False, actor_num_gpus_per_node=1,
        rollout_num_gpus=1, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8,
        rollout_max_response_len=16, eval_interval=None, update_weight_timeout=120.0,
        update_weight_buffer_size=64 * 1024)
    fields.update(over)
    return Recipe(**fields)


@pytest.fixture(scope="module")
def engine(sglang_python, vlm_path, tmp_path_factory):
    use_engine_api_key(API_KEY)
    actor = EngineActor(recipe(sglang_python), engine_index=0, model_path=vlm_path, gpu_ids=[], host="127.0.0.1",
                        backend="sglang", startup_timeout=600, log_dir=str(tmp_path_factory.mktemp("sglang-vlm-logs")))
    actor.start()
    yield actor
    actor.close()


def generate(engine: EngineActor, prompts: list[list[int]], images: list[list[Image.Image]], **params: Any) -> list:
    answers = engine.generate(GenerateRequest(
        input_ids=prompts, image_data=[[encode_image(im) for im in row] for row in images], return_logprob=True,
        sampling_params={**GREEDY, **params}))
    assert isinstance(answers, list) and len(answers) == len(prompts)
    return answers


def test_sglang_generates_from_images_as_hf_does(engine, vlm):
    model, tok, proc = vlm
    info = engine.engine_info()
    assert info["kind"] == "sglang" and info["device"] == "cpu"
    assert engine.call(Endpoint.MODEL_INFO)["has_image_understanding"] is True
    wide = vlm_prompt(tok, proc, ["look:", " n="], [WIDE])
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    two = vlm_prompt(tok, proc, ["p", "q", "="], [RED, DARK])
    text = tok.encode("next:4=")
    answers = generate(engine, [wide, red, two, text], [[WIDE], [RED], [RED, DARK], []])
    for prompt, images, answer in zip([wide, red, two], [[WIDE], [RED], [RED, DARK]], answers, strict=False):
        assert_matches_hf(model, tok, proc, prompt, images, answer)
    assert answers[3]["output_ids"] == hf_text_argmax(model, text, GREEDY["max_new_tokens"])
    # the same prompt with another image of the same size: other log-probs, each HF's
    dark = generate(engine, [red], [[DARK]])[0]
    assert_matches_hf(model, tok, proc, red, [DARK], dark)
    red_on_dark = hf_output_logprobs(model, tok, proc, red, dark["output_ids"], [RED])
    assert (logprobs(dark) - red_on_dark).abs().max() > APART, "the image did not change SGLang's log-probs"
    # one prompt alone (not a batch), its image as one data URL: the answer it had in the batch
    alone = engine.generate(GenerateRequest(input_ids=wide, image_data=encode_image(WIDE), return_logprob=True,
                                            sampling_params=GREEDY))
    assert alone["output_ids"] == answers[0]["output_ids"]
    torch.testing.assert_close(logprobs(alone), logprobs(answers[0]), atol=TOL, rtol=0)


def test_a_rollout_step_in_one_batch_and_a_stream(engine, vlm):
    """What the rollout sends: a round's samples (here 8 images x 8 samples, each with its own seed) in one batched
    request. SGLang alone fails such batches (its batched image tokenization goes prompt by prompt and drops the
    state of a prompt that finishes meanwhile: a KeyError, HTTP 500); raygym sends them one request per prompt.
    And a streamed batch with images, its rows indexed as in the batch."""
    model, tok, proc = vlm
    images = [picture((20 * k, 200 - 20 * k, 90), (250, 250, 250 - 30 * k), box=(4 * k, 6, 4 * k + 20, 40))
              for k in range(8)]
    prompts = [vlm_prompt(tok, proc, ["look:", " n="], [image]) for image in images]
    request = GenerateRequest(input_ids=[p for p in prompts for _ in range(8)],
                              image_data=[[encode_image(image)] for image in images for _ in range(8)],
                              sampling_params=[{"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": seed}
                                               for _ in images for seed in range(8)], return_logprob=True)
    answers = engine.generate(request)
    assert isinstance(answers, list) and len(answers) == 64
    # a row that finishes at once, then one whose (large) image takes SGLang a while to decode: the race, every time
    big = picture((10, 10, 10), (240, 240, 240), size=(2400, 2400), box=(100, 100, 1300, 1300))
    big_prompt = vlm_prompt(tok, proc, ["look:", " n="], [big])
    quick = engine.generate(GenerateRequest(input_ids=[tok.encode("a="), big_prompt], image_data=[[], [encode_image(big)]],
                                            sampling_params={"max_new_tokens": 1, "temperature": 0.0}))
    assert [len(a["output_ids"]) for a in quick] == [1, 1]
    for k, answer in enumerate(answers):
        prompt, image = prompts[k // 8], images[k // 8]
        assert answer["meta_info"]["prompt_tokens"] == len(prompt) and len(answer["output_ids"]) == 2
        if k % 8 == 0:  # one sample of each image against HF
            want = hf_output_logprobs(model, tok, proc, prompt, answer["output_ids"], [image])
            torch.testing.assert_close(logprobs(answer), want, atol=TOL, rtol=0)
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    wide = vlm_prompt(tok, proc, ["look:", " n="], [WIDE])
    request = GenerateRequest(input_ids=[wide, red], image_data=[[encode_image(WIDE)], [encode_image(RED)]],
                              return_logprob=True, sampling_params=GREEDY)
    whole = engine.generate(request)

    async def updates() -> list:
        return [u async for u in engine.generate_stream(request)]

    rows: dict[int, list] = {}
    for update in asyncio.run(updates()):
        rows.setdefault(update.index or 0, []).append(update)
    assert sorted(rows) == [0, 1]
    for row, seen in rows.items():
        assert seen[-1].finish_type == "length" and seen[-1].output_ids == whole[row]["output_ids"]


def test_a_request_sglang_cannot_be_given_is_refused_before_it_is_sent(engine, vlm):
    _, tok, proc = vlm
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    sampled_pad = red + [5, image_token_id(tok)]  # a response that sampled the pad, continued
    for images, needle in (([RED], r"2 run\(s\) of image pad tokens for its 1 image"),
                           ([RED, DARK], "image 1's pad tokens .* not between")):
        with pytest.raises(EngineHTTPError, match=needle) as info:
            generate(engine, [sampled_pad], [images])
        assert info.value.status == 400
    assert len(generate(engine, [tok.encode("a=")], [[]])[0]["output_ids"]) == GREEDY["max_new_tokens"]
    assert engine.health_generate(timeout=60)


class VlmTrainer(ReferenceProbe, LocalTrainer):
    """Trainer rank 0 holding the builtin tiny Qwen2.5-VL (the checkpoint's weights): its ``state_dict`` is in
    transformers' in-memory names (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``), what a
    torch-backend trainer sends. The probe scores text with it, as ``TrainerActor.probe_log_probs`` does."""

    def __init__(self) -> None:
        model, self.tok = build_tiny_vlm(0)
        self.model = model.float().eval()
        self.proc = build_image_processor()
        self.wsync = RankWeightSync(0)


class TowerDroppingTrainer(VlmTrainer):
    """A trainer whose payload, once ``drop_tower`` is set, leaves the vision tower out (as a name mapping that
    skipped ``visual.*`` would): the engine keeps its old tower under the trainer's new language model."""

    drop_tower = False

    def hf_weights(self):
        for name, tensor in super().hf_weights():
            if not (self.drop_tower and name.startswith("model.visual.")):
                yield name, tensor


def test_a_verified_sync_in_memory_names_moves_the_vision_tower_and_the_language_model(engine, sglang_python, vlm,
                                                                                         tmp_path):
    """A full sync over the group (gloo on CPU), then over disk: each verified (weight version, probe); after the
    checkpoint's weights, a state dict of other weights (in-memory names) that SGLang then answers with, its vision
    tower too (the probe scores text only; the image log-probs show the tower)."""
    model, tok, proc = vlm
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    trainer = VlmTrainer()
    names = [name for name, _ in trainer.hf_weights()]
    assert any(n.startswith("model.visual.") for n in names) and "lm_head.weight" in names
    assert any(n.startswith("model.language_model.layers.") for n in names)
    other, _ = build_tiny_vlm(1)
    other = other.float().eval()
    # the new language model with the checkpoint's vision tower: what SGLang would serve if the tower were not loaded
    mixed, _ = build_tiny_vlm(1)
    mixed.load_state_dict({**other.state_dict(), **{n: t for n, t in model.state_dict().items()
                                                    if n.startswith("model.visual.")}})
    mixed = mixed.float().eval()
    version = 0
    for transport in ("nccl", "disk"):
        trainer.model.load_state_dict(model.state_dict())  # the checkpoint's weights: calibrates the probe
        sync = WeightSync(recipe(sglang_python, update_weight_transport=transport,
                                 update_weight_disk_dir=str(tmp_path / transport)),
                          [trainer], [engine.url()], engine_kind="sglang",
                          spec_overrides={"master_address": "127.0.0.1"}, image_probe=image_probe(engine.model_path))
        sync.setup()
        try:
            for weights in (model, other):
                version += 1
                trainer.model.load_state_dict(weights.state_dict())
                metrics = sync.push(version)
                assert metrics["sync/mode"] == 0.0 and metrics["sync/full_resyncs"] == 0.0, metrics
                assert metrics["sync/verified_versions"] == 1.0 and metrics["sync/probe_tokens"] > 0, metrics
                assert metrics["sync/probe_image_tokens"] == 50, metrics  # the 48 after the image, 1 generated
                answer = generate(engine, [red], [[RED]])[0]
                assert answer["meta_info"]["weight_version"] == str(version)
                assert_matches_hf(weights, tok, proc, red, [RED], answer)
                if weights is other:
                    got, out = logprobs(answer), answer["output_ids"]
                    for before in (model, mixed):  # neither the old weights nor the old vision tower
                        old = hf_output_logprobs(before, tok, proc, red, out, [RED])
                        assert (got - old).abs().max() > APART, "SGLang still answers with the checkpoint's weights"
        finally:
            sync.shutdown()


def test_the_probe_catches_a_vision_tower_the_sync_left_out(engine, sglang_python, vlm):
    """A sync whose payload leaves the vision tower out: SGLang serves the trainer's new language model under its
    old tower. The text part of the probe cannot tell (it passes, shown with the image item off); the image item
    scores the text after a fixed image, which goes through the tower, and fails the sync, the full resync too."""
    model, _, _ = vlm
    other, _ = build_tiny_vlm(1)
    probe = image_probe(engine.model_path)
    assert probe is not None
    for with_image in (False, True):
        trainer = TowerDroppingTrainer()
        trainer.model.load_state_dict(model.state_dict())  # the checkpoint's weights, all of them: calibrates
        sync = WeightSync(recipe(sglang_python, update_weight_transport="nccl"), [trainer], [engine.url()],
                          engine_kind="sglang", spec_overrides={"master_address": "127.0.0.1"},
                          image_probe=probe if with_image else None)
        sync.setup()
        try:
            first = sync.push(1)
            assert first["sync/verified_versions"] == 1.0 and ("sync/probe_image_tokens" in first) == with_image
            trainer.model.load_state_dict(other.state_dict())
            trainer.drop_tower = True
            if not with_image:
                assert sync.push(2)["sync/verified_versions"] == 1.0  # the text-only probe misses the old tower
                continue
            with pytest.raises(WeightSyncError, match="probe log-probs after the image differ"):
                sync.push(2)
        finally:
            sync.shutdown()
