"""A multi-turn environment on a vision-language model keeps each sample's images through rollout, rewards and
training: ``raygym train`` (its own local Ray, raygym's engine, the torch trainer) runs the builtin tiny Qwen2.5-VL
for a few steps on count-shapes rows with a two-turn environment (tests/rollout/vision_env_fixture.py: say the
count, hear ``again:``, say it again; each turn is scored on the image's count).

What is checked, from the requests the rollout sent, the samples the driver handed the trainer and the metrics:

- every turn's ``/generate`` request carried exactly its sample's image (the second turn's too), and nothing else
  was sent; the same check rejects the records with one turn's image dropped or swapped;
- each episode's turns, loss mask and reward are the environment's, on its own row's image and label;
- the engine's log-probs of both turns are the tiny VLM's with the sample's image, and measurably not with
  another image or none (so a turn served without its image would show);
- the trainer's log-probs equal the engine's on every step (``rollout/logprob_mismatch_max``), far below the gap
  a batch without its images leaves, and training moved the vision tower (only the images reach it).

And, without an engine: a turn that sampled ``<|image_pad|>`` ends its episode (raygym.envs.runner), since every
engine refuses that context for the next turn; before, one such token failed the whole run with an HTTP 400.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vision_env_fixture import OBSERVATION, REQUESTS_OUT, SAMPLES_OUT, CountTwice

from raygym.builtin.count_shapes import PROMPT, count_shapes_reward, count_shapes_rows
from raygym.builtin.tiny_vlm import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    build_image_processor,
    build_tiny_vlm,
    build_vlm_tokenizer,
    image_token_id,
)
from raygym.engine_api.protocol import GenerateResponse
from raygym.envs import EpisodeRunner
from raygym.types import Sample
from raygym.vision.images import decode_image
from raygym.vision.tokens import expand_image_pads
from tests.vision_reference import MERGE, hf_output_logprobs

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
STEPS, PROMPTS, N = 3, 4, 4  # 3 steps of 4 prompts x 4 samples
TOLERANCE = 1e-4  # engine vs trainer / reference log-probs (raygym's default mismatch scale on CPU)


@dataclass
class Run:
    rows: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    requests: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    out: Path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """One ``raygym train`` of STEPS steps (a subprocess, as users run it); what it recorded and logged."""
    tmp = tmp_path_factory.mktemp("env-vision")
    rows = count_shapes_rows(16, seed=7)  # one image each, 1-4 squares
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, requests, out = tmp / "samples.jsonl", tmp / "requests.jsonl", tmp / "run"
    ray_tmp = tempfile.mkdtemp(prefix="rgev-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp, "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
           SAMPLES_OUT: str(samples), REQUESTS_OUT: str(requests)}
    env.pop("RAY_ADDRESS", None)  # its own local Ray
    flags = ["--hf-checkpoint", "builtin:tiny-qwen2.5-vl", "--prompt-data", str(data),
             "--multimodal-keys", '{"image": "images"}',
             "--rollout-env", "vision_env_fixture:CountTwice", "--rm-type", "env", "--rollout-env-max-turns", "3",
             "--rollout-max-response-len", "1",  # one token a turn: the digit
             "--num-rollout", str(STEPS), "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(N),
             "--global-batch-size", str(PROMPTS * N),
             "--entropy-coef", "0.01",  # a gradient on every step, whatever the rewards: the vision tower must move
             "--custom-rollout-log-function", "vision_env_fixture:record_samples", "--output-dir", str(out)]
    try:
        done = subprocess.run([sys.executable, "-m", "raygym", "train", *flags], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return Run(rows, read_jsonl(samples), read_jsonl(requests), read_jsonl(out / "metrics.jsonl"), out)


def turn_starts(loss_mask: list[int]) -> list[int]:
    """Where each model turn starts in a response (the first token of each run of 1s in the loss mask)."""
    return [i for i, m in enumerate(loss_mask) if m == 1 and (i == 0 or loss_mask[i - 1] == 0)]


def check_turn_requests(samples: list[dict[str, Any]], requests: list[dict[str, Any]]) -> None:
    """The requests sent are exactly one per turn of every sample: the context so far and the sample's images."""
    expected = Counter((tuple(s["prompt_tokens"] + s["response_tokens"][:start]), tuple(s["images"]))
                       for s in samples for start in turn_starts(s["loss_mask"]))
    sent = Counter((tuple(r["input_ids"]), tuple(r["image_data"] or ())) for r in requests)
    assert sent == expected, f"missing {expected - sent}; unexpected {sent - expected}"


@pytest.mark.ray  # the run's own local Ray
def test_every_turn_request_carries_its_samples_image(run):
    tok = build_vlm_tokenizer()
    pad = image_token_id(tok)
    assert len(run.samples) == STEPS * PROMPTS * N
    for s in run.samples:  # each sample kept its own row's image, in the prompt as 4 image tokens
        row = run.rows[s["data_index"]]
        assert s["images"] == row["images"] and len(s["images"]) == 1 and s["label"] == row["label"]
        assert s["prompt_tokens"].count(pad) == 4 and s["env_error"] is None
    assert len({r["pid"] for r in run.requests}) == 1  # one rollout manager sent them all
    turns = [len(turn_starts(s["loss_mask"])) for s in run.samples]
    assert len(run.requests) == sum(turns) and sum(t == 2 for t in turns) >= len(turns) // 2
    check_turn_requests(run.samples, run.requests)
    vision = {tok.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
    assert all(vision <= set(r["sampling_params"]["stop_token_ids"]) for r in run.requests)  # never sampled on
    # not vacuous: a second turn sent without its image, or with another row's, is caught
    second = next(i for i, r in enumerate(run.requests) if len(r["input_ids"]) > len(run.samples[0]["prompt_tokens"]))
    other = next(r["images"] for r in run.rows if r["images"] != run.requests[second]["image_data"])
    for lost in (None, other):
        broken = [dict(r, image_data=lost) if i == second else r for i, r in enumerate(run.requests)]
        with pytest.raises(AssertionError):
            check_turn_requests(run.samples, broken)


@pytest.mark.ray  # the run's own local Ray
def test_each_episode_is_the_environments_on_its_image(run):
    tok = build_vlm_tokenizer()
    pad = image_token_id(tok)
    observation = tok.encode(OBSERVATION, add_special_tokens=False)
    for s in run.samples:
        first = s["response_tokens"][0]
        if first == pad:  # the model sampled the image token: its episode ends there (raygym.envs.runner)
            layout = [first]
        else:
            layout = [first, *observation, s["response_tokens"][-1]]
        assert s["response_tokens"] == layout
        turns = turn_starts(s["loss_mask"])
        assert s["loss_mask"] == [1] + ([0] * len(observation) + [1] if len(layout) > 1 else [])
        assert s["metrics"]["env_turns"] == len(turns) and s["metrics"]["env_errors"] == 0.0
        said = [tok.decode([s["response_tokens"][t]], skip_special_tokens=True) for t in turns]
        expected = sum(0.5 * count_shapes_reward(text, s["label"]) for text in said)
        assert s["env_reward"] == pytest.approx(expected) and s["reward"] == pytest.approx(expected)
    assert [r["step"] for r in run.metrics] == list(range(STEPS))
    for row in run.metrics:
        assert row["rollout/env_errors"] == 0.0 and 1.0 <= row["rollout/env_turns"] <= 2.0


@functools.lru_cache(maxsize=1)
def image_processor() -> Any:
    return build_image_processor()


def model_log_probs(model: Any, tok: Any, prompt: list[int], response: list[int], images: list[str] | None
                    ) -> torch.Tensor:
    """The VLM's log-prob of each response token after ``prompt`` + the response before it: with ``images``
    (HF's own forward given the pixels and the M-RoPE positions: tests/vision_reference.py), or, ``None``, with
    the image tokens as text."""
    return hf_output_logprobs(model, tok, image_processor(), prompt, response, [decode_image(u) for u in images or []])


@pytest.mark.ray  # the run's own local Ray
def test_the_engine_generated_every_turn_from_the_samples_image(run):
    """Step 0 (the initial weights): both turns' log-probs are the VLM's with the sample's own image; with another
    row's image, or none, the second turn's differ by far more than the tolerance."""
    model, tok = build_tiny_vlm(0)
    model.eval()
    pad = image_token_id(tok)
    step0 = [s for s in run.samples if s["step"] == 0 and pad not in s["response_tokens"]]
    assert len(step0) >= PROMPTS * N // 2
    gaps: dict[str, list[float]] = {"other image": [], "no image": []}
    for s in step0:
        turns = turn_starts(s["loss_mask"])
        engine = torch.tensor(s["rollout_log_probs"])[turns]
        own = model_log_probs(model, tok, s["prompt_tokens"], s["response_tokens"], s["images"])[turns]
        torch.testing.assert_close(own, engine, atol=TOLERANCE, rtol=0)
        if len(turns) < 2:
            continue
        other = next(r["images"] for r in run.rows if r["label"] != s["label"])
        for name, images in (("other image", other), ("no image", None)):
            got = model_log_probs(model, tok, s["prompt_tokens"], s["response_tokens"], images)[turns]
            gaps[name].append(float((got - engine).abs()[-1]))  # the second turn's token
    for name, values in gaps.items():  # every second turn tells the image apart (here by 4e-3 to 1.5e-1)
        assert values and min(values) > 10 * TOLERANCE and max(values) > 100 * TOLERANCE, (name, values)


@pytest.mark.ray  # the run's own local Ray
def test_training_kept_the_images(run):
    """The trainer's log-probs (from the batch it got: tokens and images) equal the engine's on every step, and
    the vision tower, which only the images reach, moved."""
    for row in run.metrics:
        assert row["rollout/logprob_mismatch_max"] < TOLERANCE, row
        assert row["train/grad_norm"] > 0.0
    from transformers import AutoModelForImageTextToText

    trained = AutoModelForImageTextToText.from_pretrained(run.out / "hf", dtype=torch.float32)
    initial, _ = build_tiny_vlm(0)
    before = dict(initial.model.visual.named_parameters())
    moved = [name for name, p in trained.model.visual.named_parameters() if not torch.equal(p, before[name])]
    assert len(moved) > len(before) // 2, moved


# ----------------------------------------------------------------------------- no engine: the image-token guard


def test_a_turn_that_sampled_the_image_token_ends_the_episode():
    from raygym.engines.raygym_server.vision_inputs import VisionSupport

    tok = build_vlm_tokenizer()
    pad = image_token_id(tok)
    row = count_shapes_rows(1, seed=3)[0]
    grids = image_processor()(images=[decode_image(row["images"][0])])["image_grid_thw"].tolist()
    prompt = expand_image_pads(tok.encode(PROMPT, add_special_tokens=False), image_token=pad, grids=grids, merge=MERGE)

    def play(first: int) -> tuple[Sample, list[list[int]]]:
        sent: list[list[int]] = []

        async def generate(input_ids: list[int], params: dict[str, Any]) -> GenerateResponse:  # a scripted engine
            sent.append(list(input_ids))
            token = first if len(sent) == 1 else tok.convert_tokens_to_ids(row["label"])
            return GenerateResponse.model_validate({"text": "", "output_ids": [token], "meta_info": {
                "id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": len(input_ids),
                "completion_tokens": 1, "output_token_logprobs": [[-1.5, token, None]]}})

        sample = Sample(prompt=row["prompt"], prompt_tokens=list(prompt), group_index=0, label=row["label"],
                        images=list(row["images"]))
        runner = EpisodeRunner(CountTwice, tok, max_turns=3)
        return asyncio.run(runner(None, sample, {"max_new_tokens": 1}, generate)), sent

    digit = tok.convert_tokens_to_ids(row["label"])
    both, sent = play(digit)  # a digit: the environment answers and the model takes its second turn
    assert len(sent) == 2 and both.metrics["env_turns"] == 2 and both.metadata["env_reward"] == 1.0
    ended, sent = play(pad)
    assert sent == [prompt] and ended.response_tokens == [pad] and ended.loss_mask == [1]
    assert ended.metrics["env_turns"] == 1 and ended.metadata["env_reward"] == 0.0 and ended.finish_reason == "length"
    # the context a second turn would have sent: raygym's server refuses it (one pad too many for the image)
    support = VisionSupport(image_token_id=pad, merge_size=MERGE, image_processor=image_processor(),
                            model_name="tiny")
    support.prepare(sent[0], row["images"])
    with pytest.raises(ValueError, match="5 image token"):
        support.prepare(sent[0] + [pad] + tok.encode(OBSERVATION, add_special_tokens=False), row["images"])
