"""``raygym bench gpu_check_vlm`` without a GPU: the skipped lines (no CUDA device; no engine installed), and its
HF reference on the CPU: the image prompt as raygym widens it, the log-probs HF gives it (the image's features put
in at the prompt's pads, M-RoPE positions as the engines place them) and how an engine's answer is judged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from raygym.bench import gpu_check_vlm as check
from raygym.builtin.tiny_vlm import build_tiny_vlm, materialize_vlm
from raygym.engine_api.protocol import GenerateResponse

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the in-process reference forwards


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(check, "DEVICE", "cpu")


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return materialize_vlm(tmp_path_factory.mktemp("vlm"))


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_without_a_cuda_device_it_says_so_and_exits_0():
    done = subprocess.run([sys.executable, "-m", "raygym.bench.gpu_check_vlm"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    [row] = lines(done.stdout)
    assert (row["figure"], row["skipped"]) == ("vlm_gpu_check", "no CUDA device")


def test_an_engine_that_is_not_installed_is_a_skipped_line(monkeypatch, capsys):
    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check, "sglang_missing", lambda python: f"{python} cannot import sglang")
    monkeypatch.setattr(check, "vllm_missing", lambda python: f"{python}: it cannot import vllm")
    monkeypatch.setattr(sys, "argv", ["gpu_check_vlm", "--sglang-python", "/x/python", "--vllm-python", "/y/python"])
    check.main()  # nothing to start: no model is built either
    assert [(r["figure"], r["skipped"]) for r in lines(capsys.readouterr().out)] == [
        ("vlm_sglang", "/x/python cannot import sglang"), ("vlm_vllm", "/y/python: it cannot import vllm")]


def test_the_reference_puts_the_image_where_hf_does(vlm_path, on_cpu):
    prompt = check.ImagePrompt.build(vlm_path)
    assert prompt.tokens.count(prompt.image_token) == 4  # a 56x56 picture: 4x4 patches merged 2x2
    assert prompt.image.size == prompt.other.size
    model = check.load_vlm(vlm_path).eval()
    output = [21, prompt.image_token, 44]  # a generated pad is text
    text_output = [21, 44, 21]
    mine, argmax = prompt.hf_logprobs(model, text_output, prompt.image)
    inputs = prompt.model_inputs(text_output, prompt.image)
    with torch.no_grad():  # HF's own path: pixel values in, features placed by HF
        logits = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits[0]
    lsm = torch.log_softmax(logits[len(prompt.tokens) - 1:-1], -1)
    assert mine == pytest.approx(lsm.gather(-1, torch.tensor(text_output)[:, None]).squeeze(-1).tolist(), abs=1e-6)
    assert argmax == lsm.argmax(-1).tolist()
    other, _ = prompt.hf_logprobs(model, text_output, prompt.other)
    assert max(check.abs_diffs(mine, other)) > 1e-3  # the picture matters
    assert len(prompt.hf_logprobs(model, output, prompt.image)[0]) == 3


class FakeEngine:
    """Answers the image prompt with HF's greedy tokens and its log-probs moved by ``shift``."""

    def __init__(self, prompt: check.ImagePrompt, model, shift: float, prompt_tokens: int | None = None) -> None:
        self.prompt, self.model, self.shift = prompt, model, shift
        self.prompt_tokens = len(prompt.tokens) if prompt_tokens is None else prompt_tokens

    def generate(self, request):
        assert request.input_ids == self.prompt.tokens and len(request.image_data) == 1
        output: list[int] = []
        for _ in range(check.GREEDY["max_new_tokens"]):
            output.append(self.prompt.hf_logprobs(self.model, output + [0], self.prompt.image)[1][-1])
        values = [lp + self.shift for lp in self.prompt.hf_logprobs(self.model, output, self.prompt.image)[0]]
        return GenerateResponse.model_validate({
            "text": "", "output_ids": output, "meta_info": {
                "id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(output), "weight_version": "1",
                "output_token_logprobs": [[v, t, None] for v, t in zip(values, output, strict=True)]}})


def test_an_answer_is_judged_against_the_reference(vlm_path, on_cpu):
    prompt = check.ImagePrompt.build(vlm_path)
    model = check.load_vlm(vlm_path).eval()
    old = build_tiny_vlm(1)[0].float().eval()  # other weights: what the engine served before a sync
    fields = check.compare(FakeEngine(prompt, model, shift=0.01), prompt, model, old_model=old)
    assert fields["ok"] and fields["value"] == pytest.approx(0.01, abs=1e-5) and fields["greedy_agree"] == 1.0
    assert fields["tokens"] == check.GREEDY["max_new_tokens"] and fields["weight_version"] == "1"
    assert fields["old_weights_diff"] > 10 * fields["value"]
    assert fields["other_image_diff"] > fields["value"]
    assert not check.compare(FakeEngine(prompt, model, shift=0.1), prompt, model)["ok"]  # beyond the tolerance
    miscounted = check.compare(FakeEngine(prompt, model, shift=0.0, prompt_tokens=len(prompt.tokens) - 3), prompt, model)
    assert not miscounted["ok"] and miscounted["widened_prompt_tokens"] == len(prompt.tokens)
