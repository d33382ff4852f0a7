"""Images on vLLM through raygym's adapter (vLLM's CPU build, its own interpreter), on the builtin tiny Qwen2.5-VL:
greedy generation from widened prompts and ``image_data`` against HF's forward pass (system python), images that
change the log-probs, 400s for requests that cannot be served, and a verified full weight sync in the trainer's
in-memory names that moves both the vision tower and the language model.

The first tests need no vLLM: the adapter's ``/generate`` route refuses images before anything reaches vLLM, and
the prompt conversion is pure."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from raygym.builtin.tiny_vlm import (
    IMAGE_PLACEHOLDER,
    build_image_processor,
    build_tiny_vlm,
    image_token_id,
    materialize_vlm,
)
from raygym.engine_api.auth import use_engine_api_key
from raygym.engine_api.protocol import Endpoint, GenerateRequest
from raygym.engines.serving.generate_route import read_generate
from raygym.engines.vllm.vision import (
    ImageInputError,
    VllmVision,
    collapse_image_pads,
    tokenizer_with_video_token,
    vllm_prompts,
)
from raygym.vision.images import encode_image
from raygym.vision.tokens import mrope_positions
from raygym.weightsync.sender import RankWeightSync
from tests.vision_reference import (
    DARK,
    MERGE,
    RED,
    WIDE,
    ReferenceProbe,
    hf_log_softmax,
    hf_logprobs,
    hf_text_argmax,
    vlm_prompt,
)
from tests.weightsync.local_trainer import LocalTrainer

API_KEY = "vllm-vision-test-key"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm():
    model, tok = build_tiny_vlm(0)
    return model.eval(), tok, build_image_processor()


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return materialize_vlm(tmp_path_factory.mktemp("vllm-vlm"))


# ----- without vLLM: the prompt conversion and the adapter's refusals -----


def test_widened_prompts_become_one_pad_per_image(vlm, vlm_path):
    _, tok, proc = vlm
    pad = image_token_id(tok)
    prompt = vlm_prompt(tok, proc, ["p", "q", "="], [RED, WIDE])
    assert prompt.count(pad) == 4 + 6
    assert collapse_image_pads(prompt, image_token=pad, per_image=[4, 6]) == tok.encode(IMAGE_PLACEHOLDER.join("pq="))
    vision = VllmVision.from_checkpoint(vlm_path)
    assert vision is not None and vision.unsupported is None and vision.image_token_id == pad
    assert [vision.tokens_per_image(image) for image in (RED, WIDE, DARK)] == [4, 6, 4]
    call = read_generate(GenerateRequest(input_ids=[prompt, tok.encode("a")], sampling_params={"n": 2},
                                         image_data=[[encode_image(RED), encode_image(WIDE)], []]),
                         vocab_size=len(tok), encode=None, parse_params=lambda p: (p, p.get("n", 1)))
    assert [len(job.images) for job in call.jobs] == [2, 2, 0, 0]
    prompts = vllm_prompts(vision, vlm_path, call.jobs)
    assert prompts[0] is prompts[1] and prompts[0]["prompt_token_ids"] == tok.encode(IMAGE_PLACEHOLDER.join("pq="))
    assert [im.size for im in prompts[0]["multi_modal_data"]["image"]] == [RED.size, WIDE.size]
    assert prompts[2] == {"prompt_token_ids": tok.encode("a")}
    with pytest.raises(ImageInputError, match=r"has 10 image token\(s\) .* but its 2 image\(s\) need 8"):
        vision.prompt(prompt, [encode_image(RED), encode_image(DARK)])
    with pytest.raises(ImageInputError, match="not one unbroken run"):  # the counts add up, the runs do not
        vision.prompt(prompt, [encode_image(WIDE), encode_image(RED)])
    with pytest.raises(ImageInputError, match="no image_data"):
        vision.prompt(prompt, [])


def test_a_tokenizer_without_a_video_token_gets_a_copy_naming_it(vlm, vlm_path, tmp_path):
    """vLLM's Qwen2-VL processing looks the video token up for every request with images; the builtin VLM's
    tokenizer has no ``<|video_pad|>`` (its config's video_token_id is the image pad)."""
    from transformers import AutoTokenizer

    from raygym.builtin import TINY_MODEL, materialize_model
    from raygym.vision.qwen_vl import IMAGE_PAD

    _, tok, _ = vlm
    copy = tokenizer_with_video_token(vlm_path, str(tmp_path / "tok"))
    assert copy is not None and not list(Path(copy).glob("*.safetensors"))
    named = AutoTokenizer.from_pretrained(copy)
    assert named.video_token == IMAGE_PAD and len(named) == len(tok)
    text = IMAGE_PLACEHOLDER.join(["look:", " n=", "!"])
    assert named.encode(text) == tok.encode(text) == AutoTokenizer.from_pretrained(vlm_path).encode(text)
    assert tokenizer_with_video_token(copy) is None  # named already
    assert tokenizer_with_video_token(materialize_model(TINY_MODEL, tmp_path / "text")) is None


class StubLLM:
    """What the adapter asks of vLLM's engine before generating (nothing here generates)."""

    errored = False

    def get_tokenizer(self) -> Any:
        raise AssertionError("not asked for token-id prompts")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a refused request reached vLLM")


def adapter_error(model_path: str, vision: VllmVision | None, body: dict[str, Any]) -> tuple[int, str]:
    from aiohttp.test_utils import TestClient, TestServer

    from raygym.engines.vllm.server import VllmAdapter

    async def go() -> tuple[int, str]:
        adapter = VllmAdapter(StubLLM(), model_path=model_path, vocab_size=64, eos_token_id=1, weight_version="0",
                              device="cpu", sleep_mode=False, timeout_s=30.0, vision=vision)
        async with TestClient(TestServer(adapter.app())) as client:
            response = await client.post("/generate", json=body)
            return response.status, await response.text()

    return asyncio.run(go())


def test_the_adapter_refuses_images_it_cannot_serve_with_400(vlm, vlm_path, tmp_path):
    from raygym.builtin import TINY_MODEL, materialize_model

    _, tok, proc = vlm
    text_path = materialize_model(TINY_MODEL, tmp_path)
    assert VllmVision.from_checkpoint(text_path) is None
    status, message = adapter_error(text_path, None, {"input_ids": [3, 4, 5], "image_data": encode_image(RED)})
    assert status == 400 and f"the model {text_path} is a text-only model" in message, message
    vision = VllmVision.from_checkpoint(vlm_path)
    prompt = vlm_prompt(tok, proc, ["look:", " n="], [RED])  # 4 image tokens
    status, message = adapter_error(vlm_path, vision, {"input_ids": prompt, "image_data": encode_image(WIDE)})
    assert status == 400 and "has 4 image token(s)" in message and "need 6" in message, message
    status, message = adapter_error(vlm_path, vision, {"input_ids": prompt, "image_data": "data:image/png;base64,AAAA"})
    assert status == 400 and "image 0" in message and "not a readable image" in message, message
    status, message = adapter_error(vlm_path, vision, {"input_ids": prompt})
    assert status == 400 and "no image_data" in message, message
    status, message = adapter_error(vlm_path, vision, {"input_ids": [prompt, [3]], "image_data": [encode_image(RED)]})
    assert status == 400 and "1 for 2 prompts" in message, message


# ----- on vLLM -----


def recipe(python: str) -> Any:
    from raygym.config import Recipe

    return Recipe(rollout_engine="vllm", rollout_engine_python=python, colocate=False, actor_num_gpus_per_node=1,
                  rollout_num_gpus=1, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8,
                  rollout_max_response_len=64, rollout_max_prompt_len=64, eval_interval=None,
                  update_weight_timeout=120.0, update_weight_buffer_size=64 * 1024)


@pytest.fixture(scope="module")
def engine(vllm_python, vlm_path, tmp_path_factory):
    from raygym.engines.actor import EngineActor

    use_engine_api_key(API_KEY)
    actor = EngineActor(recipe(vllm_python), engine_index=0,
                        model_path=vlm_path, gpu_ids=[], host="127.0.0.1", backend="vllm", startup_timeout=600,
                        log_dir=str(tmp_path_factory.mktemp("vllm-vlm-logs")), extra_server_args=["--dtype", "float32"])
    actor.start()
    yield actor
    actor.close()


def generate(engine: Any, prompts: list[list[int]], images: list[list[Image.Image]], **params: Any) -> list[dict]:
    return engine.generate(GenerateRequest(
        input_ids=prompts, image_data=[[encode_image(im) for im in row] for row in images], return_logprob=True,
        logprob_start_len=0, sampling_params={**GREEDY, **params}))


def logprobs(answer: dict, key: str = "output_token_logprobs") -> torch.Tensor:
    """The answer's log-probs under ``key`` (the prompt's without its first token's None)."""
    values = [lp for lp, _, _ in answer["meta_info"][key]]
    return torch.tensor(values[1:] if key == "input_token_logprobs" else values)


def assert_matches_hf(model: Any, tok: Any, proc: Any, prompt: list[int], images: list[Image.Image],
                      answer: dict, atol: float = 1e-4) -> None:
    """The engine's greedy tokens are HF's argmax, its output and prompt log-probs HF's."""
    out = answer["output_ids"]
    hf = hf_log_softmax(model, tok, proc, prompt, out, images)
    assert out == hf[len(prompt) - 1:].argmax(-1).tolist()
    want = hf.gather(-1, torch.tensor((prompt + out)[1:])[:, None]).squeeze(-1)
    meta = answer["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) and [t for _, t, _ in meta["input_token_logprobs"]] == prompt
    torch.testing.assert_close(logprobs(answer), want[len(prompt) - 1:], atol=atol, rtol=0)
    torch.testing.assert_close(logprobs(answer, "input_token_logprobs"), want[:len(prompt) - 1], atol=atol, rtol=0)


@pytest.mark.vllm_cpu
@pytest.mark.timeout(1500)
def test_generation_from_images_matches_hf(engine, vlm):
    model, tok, proc = vlm
    info = engine.call(Endpoint.MODEL_INFO)
    assert info["has_image_understanding"] is True and info["dtype"] == "float32"
    wide = vlm_prompt(tok, proc, ["look:", " n="], [WIDE])
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    two = vlm_prompt(tok, proc, ["p", "q", "="], [RED, DARK])
    text = tok.encode("next:4=")
    answers = generate(engine, [wide, red, two, text], [[WIDE], [RED], [RED, DARK], []])
    for prompt, images, answer in zip([wide, red, two], [[WIDE], [RED], [RED, DARK]], answers, strict=False):
        assert_matches_hf(model, tok, proc, prompt, images, answer)
    assert answers[3]["output_ids"] == hf_text_argmax(model, text, 6)
    # the same prompt with another image of the same size: other log-probs, each HF's
    dark = generate(engine, [red], [[DARK]])[0]
    red_lp, dark_lp = logprobs(answers[1]), logprobs(dark)
    dark_want = hf_logprobs(model, tok, proc, red, dark["output_ids"], [DARK])[len(red) - 1:]
    torch.testing.assert_close(dark_lp, dark_want, atol=1e-3, rtol=0)
    red_on_dark = hf_logprobs(model, tok, proc, red, dark["output_ids"], [RED])[len(red) - 1:]
    assert (dark_lp - red_on_dark).abs().max() > 1e-2, "the image did not change the log-probs"
    if dark["output_ids"] == answers[1]["output_ids"]:
        assert (red_lp - dark_lp).abs().max() > 1e-2
    # n samples of one image prompt share its images; a prompt alone answers as in the batch
    samples = engine.generate(GenerateRequest(input_ids=wide, image_data=encode_image(WIDE), return_logprob=True,
                                              sampling_params={**GREEDY, "n": 2}))
    assert [s["output_ids"] for s in samples] == [answers[0]["output_ids"]] * 2


@pytest.mark.vllm_cpu
@pytest.mark.timeout(600)
def test_requests_vllm_cannot_serve_are_400_and_text_still_works(engine, vlm):
    from raygym.engine_api.client import EngineHTTPError

    _, tok, proc = vlm
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    for images, needle in (([WIDE], "need 6"), ([], "no image_data")):
        with pytest.raises(EngineHTTPError, match=needle) as info:
            generate(engine, [red], [images])
        assert info.value.status == 400
    assert len(generate(engine, [tok.encode("a=")], [[]])[0]["output_ids"]) == 6
    assert engine.health_generate(timeout=30)


# ----- weight sync in the trainer's in-memory names -----


class VlmTrainer(ReferenceProbe, LocalTrainer):
    """Trainer rank 0 holding a Qwen2.5-VL (the builtin tiny one of ``seed``): its ``state_dict`` is in
    transformers' in-memory names (``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``), what a
    torch-backend trainer sends. ``train_step`` trains on an image, so the vision tower moves too."""

    def __init__(self, seed: int, lr: float = 2e-2):
        model, self.tok = build_tiny_vlm(seed)
        self.model = model.float()
        self.proc = build_image_processor()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.wsync = RankWeightSync(0)

    def train_step(self) -> None:
        prompt = vlm_prompt(self.tok, self.proc, ["look:", " n=7"], [RED])
        processed = self.proc(images=[RED], return_tensors="pt")
        positions, _ = mrope_positions(prompt, image_token=image_token_id(self.tok),
                                       grids=processed["image_grid_thw"].tolist(), merge=MERGE)
        ids = torch.tensor([prompt])
        loss = self.model(input_ids=ids, labels=ids, position_ids=torch.tensor(positions)[:, None, :],
                          pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


@pytest.mark.vllm_cpu
@pytest.mark.timeout(1500)
def test_a_verified_full_sync_moves_the_vision_tower_and_the_language_model(engine, vllm_python, vlm, tmp_path):
    from raygym.weightsync.coordinator import WeightSync
    from raygym.weightsync.probe_image import image_probe

    model, tok, proc = vlm
    red = vlm_prompt(tok, proc, ["look:", " n="], [RED])
    trainer = VlmTrainer(seed=1)
    names = [name for name, _ in trainer.hf_weights()]
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.layers.")
                                                                    for n in names)
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    sync = WeightSync(recipe(vllm_python), [trainer], [engine.url()], engine_kind="vllm", session=True,
                      spec_overrides={"master_address": "127.0.0.1"}, image_probe=image_probe(engine.model_path))
    sync.setup()
    try:
        for version in (1, 2):
            if version > 1:
                visual = trainer.model.state_dict()["model.visual.blocks.0.mlp.up_proj.weight"].clone()
                trainer.train_step()
                assert not torch.equal(visual, trainer.model.state_dict()["model.visual.blocks.0.mlp.up_proj.weight"])
            metrics = sync.push(version)
            assert metrics["sync/mode"] == 0.0 and metrics["sync/full_resyncs"] == 0.0
            assert metrics["sync/verified_versions"] == 1.0 and metrics["sync/verified_tensors"] == len(names)
            assert metrics["sync/probe_tokens"] > 0 and metrics["sync/probe_logprob_diff_mean"] <= 1e-3
            assert metrics["sync/probe_image_tokens"] == 50 and metrics["sync/probe_image_logprob_diff_mean"] <= 1e-3
            answer = generate(engine, [red], [[RED]])[0]
            assert answer["meta_info"]["weight_version"] == str(version)
            assert_matches_hf(trainer.model.eval(), tok, proc, red, [RED], answer)
            old = hf_logprobs(model, tok, proc, red, answer["output_ids"], [RED])[len(red) - 1:]
            assert (logprobs(answer) - old).abs().max() > 1e-2  # no longer the checkpoint's
    finally:
        sync.shutdown()
