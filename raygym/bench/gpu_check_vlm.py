"""GPU check of a vision-language model on SGLang and vLLM: image log-probs vs HF, one verified sync.

The model is the builtin tiny Qwen2.5-VL (``builtin:tiny-qwen2.5-vl``), on stock SGLang and on vLLM behind raygym's
adapter, one GPU, one engine after the other. Per engine, each step printed as one JSON line as it finishes (a
failing step prints its error and the next ones still run):

  1. start-up time and what the engine reports;
  2. one greedy ``/generate`` of an image prompt as raygym sends it (the image's pad widened to its tokens,
     :func:`raygym.vision.tokens.expand_image_pads`; a ``builtin:count-shapes`` picture as a PNG data URL), its
     log-probs against HF transformers' forward pass of the same checkpoint and image on the GPU (fp32, M-RoPE
     positions as the engines place them), and against HF's with another picture (which should differ more);
  3. one verified weight sync over disk (:class:`raygym.weightsync.coordinator.WeightSync`: weight version read
     back, probe of log-probs), after an AdamW step on the image prompt that moves the vision tower too, then the
     image prompt again against the trained weights and against the checkpoint's.

    raygym bench gpu_check_vlm [--sglang-python PY] [--vllm-python PY]     (scripts/gpu_check.sh runs it)

Needs a CUDA device, and SGLang importable by ``--sglang-python`` (default: this interpreter) or vLLM's CUDA build
by ``--vllm-python`` (default: ``RAYGYM_VLLM_PYTHON``, else this interpreter); whatever is missing is said in a
``skipped`` line and the script exits 0. Budget: the 240 seconds scripts/gpu_check.sh gives it, each engine's
start-up held to :data:`STARTUP_S` (not yet timed on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from raygym.bench.gpu_check_sglang import Trainer

if TYPE_CHECKING:
    from PIL import Image

    from raygym.engine_api.protocol import GenerateRequest
    from raygym.engines.actor import EngineActor

T0 = time.time()
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
MISMATCH_TOL = 0.05  # mean |engine - HF fp32| log-prob allowed: an engine may serve the fp32 checkpoint in 16 bits
STARTUP_S = 90.0  # each engine's start-up limit, so that one that hangs leaves the other its time
LR = 2e-2  # the one AdamW step before the sync: far enough that the engine's answers must change
DEVICE = "cuda"  # where the HF reference and the trainer run (the unit tests run the reference on "cpu")


def emit(figure: str, **fields: Any) -> None:
    print(json.dumps({"figure": figure, "elapsed_s": round(time.time() - T0, 1), **fields}), flush=True)


def attempt(figure: str, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``; an exception is printed as ``<figure>_failed`` and the check goes on."""
    try:
        fn(*args)
    except Exception as exc:
        emit(f"{figure}_failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])


def sglang_missing(python: str) -> str | None:
    """Why ``python`` cannot run stock SGLang, or None."""
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode != 0:
        return f"{python} cannot import sglang: install raygym[sglang] there"
    return None


def vllm_missing(python: str) -> str | None:
    """Why ``python`` cannot run vLLM on the GPU, or None (as :mod:`raygym.bench.gpu_check_vllm` asks)."""
    probe = subprocess.run([python, "-c", "from vllm.platforms import current_platform as p; "
                            "raise SystemExit(0 if p.is_cuda() else 3)"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    why = "its vLLM is not a CUDA build" if probe.returncode == 3 else "it cannot import vllm"
    return f"{python}: {why}; install vLLM there (pip install vllm) or set RAYGYM_VLLM_PYTHON"


@dataclass(frozen=True)
class ImagePrompt:
    """The prompt every step sends: ``builtin:count-shapes``' prompt with one picture, its pad widened (``tokens``)
    as raygym's rollouts send it; ``other`` is another picture of the same size (as many image tokens)."""

    tokens: list[int]
    image: Image.Image
    other: Image.Image
    image_token: int
    merge: int
    processor: Any

    @classmethod
    def build(cls, model_path: str) -> ImagePrompt:
        from transformers import AutoTokenizer

        from raygym.builtin.count_shapes import PROMPT, draw_shapes
        from raygym.builtin.tiny_vlm import image_token_id
        from raygym.vision.dataset import load_image_processor
        from raygym.vision.tokens import expand_image_pads

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        processor = load_image_processor(model_path)
        rng = random.Random(0)
        image, other = draw_shapes(3, rng), draw_shapes(1, rng)
        merge = int(processor.merge_size)
        pad = image_token_id(tokenizer)
        grids = processor(images=[image])["image_grid_thw"].tolist()
        tokens = expand_image_pads(tokenizer.encode(PROMPT, add_special_tokens=False), image_token=pad, grids=grids,
                                   merge=merge)
        return cls(tokens, image, other, pad, merge, processor)

    def model_inputs(self, output: list[int], image: Image.Image) -> dict[str, torch.Tensor]:
        """HF forward inputs (on :data:`DEVICE`) of ``tokens + output`` with ``image``: the ids, the image's pixels and
        grid, ``image_at`` (the prompt's pads, where the image's features go: a generated pad is text) and the
        M-RoPE positions the engines give (a generated token: its index plus the prompt's delta)."""
        from raygym.vision.tokens import mrope_positions

        processed = self.processor(images=[image], return_tensors="pt")
        grids = processed["image_grid_thw"]
        positions, delta = mrope_positions(self.tokens, image_token=self.image_token, grids=grids.tolist(),
                                           merge=self.merge)
        n = len(self.tokens)
        positions = [row + [n + k + delta for k in range(len(output))] for row in positions]
        at = torch.tensor([[t == self.image_token for t in self.tokens] + [False] * len(output)], device=DEVICE)
        return {"input_ids": torch.tensor([self.tokens + output], device=DEVICE),
                "position_ids": torch.tensor(positions, device=DEVICE)[:, None, :],
                "pixel_values": processed["pixel_values"].to(DEVICE), "image_grid_thw": grids.to(DEVICE),
                "image_at": at}

    def hf_logprobs(self, model: Any, output: list[int], image: Image.Image) -> tuple[list[float], list[int]]:
        """HF's log-probs of ``output`` after the prompt with ``image``, and its argmax at each of those places."""
        inputs = self.model_inputs(output, image)
        with torch.no_grad():
            embeds = model.get_input_embeddings()(inputs["input_ids"])
            features = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            features = torch.cat(list(features)).to(embeds.dtype)
            embeds = embeds.masked_scatter(inputs["image_at"][..., None], features)
            logits = model(inputs_embeds=embeds, position_ids=inputs["position_ids"]).logits[0]
        lsm = torch.log_softmax(logits[len(self.tokens) - 1:-1].float(), -1)
        picked = lsm.gather(-1, torch.tensor(output, device=DEVICE)[:, None]).squeeze(-1)
        return picked.tolist(), lsm.argmax(-1).tolist()

    def request(self) -> GenerateRequest:
        from raygym.engine_api.protocol import GenerateRequest
        from raygym.vision.images import encode_image

        return GenerateRequest(input_ids=self.tokens, image_data=[encode_image(self.image)], return_logprob=True,
                               sampling_params=GREEDY)


def load_vlm(model_path: str) -> torch.nn.Module:
    """The checkpoint as HF transformers loads it, in fp32 on :data:`DEVICE`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model: torch.nn.Module = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32)
    return model.to(DEVICE)


def abs_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b, strict=True)]


def compare(engine: EngineActor, prompt: ImagePrompt, model: Any, old_model: Any | None = None) -> dict[str, Any]:
    """The engine's greedy answer to the image prompt, its log-probs against HF ``model``'s of the same tokens:
    ``value`` (the mean difference; ``ok`` when within :data:`MISMATCH_TOL` and the engine counts the widened
    prompt's tokens), ``greedy_agree`` (how often HF's argmax is the engine's token), ``other_image_diff`` (against
    HF's with the other picture: well above ``value`` when the engine looks at the image) and, with ``old_model``
    (the weights before a sync), ``old_weights_diff`` (well above ``value`` when the sync reached the engine)."""
    answer = engine.generate(prompt.request())
    assert not isinstance(answer, list), "one prompt, one answer"
    output, engine_lp = answer.tokens_and_logprobs()
    assert len(engine_lp) == len(output) == GREEDY["max_new_tokens"], f"{len(output)} tokens, {len(engine_lp)} log-probs"
    hf_lp, argmax = prompt.hf_logprobs(model, output, prompt.image)
    diffs = abs_diffs(engine_lp, hf_lp)
    mean = statistics.fmean(diffs)
    prompt_tokens = answer.meta_info.prompt_tokens
    fields: dict[str, Any] = {
        "value": mean, "max_abs_diff": max(diffs), "tokens": len(diffs), "tolerance": MISMATCH_TOL,
        "ok": mean <= MISMATCH_TOL and prompt_tokens == len(prompt.tokens), "prompt_tokens": prompt_tokens,
        "widened_prompt_tokens": len(prompt.tokens),
        "greedy_agree": statistics.fmean(a == t for a, t in zip(argmax, output, strict=True)),
        "other_image_diff": statistics.fmean(abs_diffs(engine_lp, prompt.hf_logprobs(model, output, prompt.other)[0])),
        "weight_version": answer.meta_info.weight_version}
    if old_model is not None:
        old_lp = prompt.hf_logprobs(old_model, output, prompt.image)[0]
        fields["old_weights_diff"] = statistics.fmean(abs_diffs(engine_lp, old_lp))
    return fields


class VlmTrainer(Trainer):
    """Trainer rank 0 in this process on the GPU (fp32) holding the VLM under transformers' in-memory names
    (``model.language_model.*``, ``model.visual.*``): what a torch-backend trainer sends. A step trains on the image
    prompt, so the vision tower moves as well; the probe scores text (inherited) and its image item with HF's
    forward pass of the image."""

    def __init__(self, model_path: str, prompt: ImagePrompt) -> None:
        from raygym.weightsync.sender import RankWeightSync

        self.model = load_vlm(model_path)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.wsync = RankWeightSync(0)
        self.prompt = prompt

    def probe_log_probs(self, prompts: list[list[int]], responses: list[list[int]],
                        images: list[list[str]] | None = None) -> list[list[float]]:
        from dataclasses import replace

        from raygym.vision.images import decode_image

        out = []
        for prompt, response, urls in zip(prompts, responses, images or [[] for _ in prompts], strict=True):
            if not urls:
                out.extend(super().probe_log_probs([prompt], [response]))
                continue
            image = decode_image(urls[0])
            out.append(replace(self.prompt, tokens=list(prompt), image=image).hf_logprobs(self.model, response, image)[0])
        return out

    def step(self) -> None:
        inputs = self.prompt.model_inputs([], self.prompt.image)
        ids = inputs["input_ids"]
        self.model(input_ids=ids, labels=ids, position_ids=inputs["position_ids"], pixel_values=inputs["pixel_values"],
                   image_grid_thw=inputs["image_grid_thw"]).loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def check_engine(kind: str, python: str, model_path: str, prompt: ImagePrompt, reference: Any) -> None:
    """Start engine ``kind`` on the VLM as a run would, compare an image prompt's log-probs with HF's, sync once."""
    from raygym.config import Recipe
    from raygym.engine_api.kinds import weight_update_session
    from raygym.engines.actor import EngineActor
    from raygym.run.graph import checkpoint_dtype
    from raygym.weightsync.coordinator import WeightSync
    from raygym.weightsync.probe_image import image_probe

    base: dict[str, Any] = dict(
        rollout_engine=kind, rollout_engine_python=python, colocate=False, actor_num_gpus_per_node=1,
        rollout_num_gpus=1, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8, eval_interval=None,
        rollout_max_prompt_len=128, rollout_max_response_len=16, sglang_mem_fraction_static=0.2,
        update_weight_transport="disk", update_weight_disk_dir=tempfile.mkdtemp(prefix=f"vlm-sync-{kind}-"),
        update_weight_timeout=60.0)
    if kind == "sglang":  # kernels that take the tiny VLM's narrow heads (32; 16 in the vision tower), which
        # SGLang's default FlashAttention-3 / FlashInfer builds may not; no CUDA graphs, as gpu_check_sglang
        base["sglang_config"] = {"disable_cuda_graph": True, "attention_backend": "triton",
                                 "mm_attention_backend": "sdpa"}
    recipe = Recipe(**base)
    engine = EngineActor(recipe, engine_index=0, model_path=model_path, gpu_ids=[0], host="127.0.0.1", backend=kind,
                         startup_timeout=STARTUP_S, request_timeout=60.0,
                         extra_server_args=["--enforce-eager"] if kind == "vllm" else None)
    try:
        start = time.time()
        engine.start()
        info = engine.engine_info()
        emit(f"vlm_{kind}_started", seconds=round(time.time() - start, 1), info=info)

        def logprobs() -> None:
            emit(f"vlm_{kind}_logprob_mismatch", trainer="hf_fp32_same_gpu", **compare(engine, prompt, reference))

        def sync() -> None:
            trainer = VlmTrainer(model_path, prompt)
            # as the run's fleet sets it up (raygym/engines/fleet.py): the engine's dtype, else the checkpoint's
            overrides = {"cast_dtype": info.get("dtype") or checkpoint_dtype(model_path), "master_address": "127.0.0.1"}
            weight_sync = WeightSync(recipe, [trainer], [engine.url()], engine_kind=kind,
                                     session=weight_update_session(kind, info.get("version")), spec_overrides=overrides,
                                     image_probe=image_probe(model_path))
            try:
                weight_sync.setup()
                trainer.step()
                metrics = weight_sync.push(1)
            finally:
                weight_sync.shutdown()
            emit(f"vlm_{kind}_sync", transport="disk", version=1,
                 metrics={k: v for k, v in metrics.items() if k.startswith("sync/")})
            emit(f"vlm_{kind}_after_sync", **compare(engine, prompt, trainer.model.eval(), old_model=reference))

        attempt(f"vlm_{kind}_logprob_mismatch", logprobs)
        attempt(f"vlm_{kind}_sync", sync)
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sglang-python", default=sys.executable)
    p.add_argument("--vllm-python", default=os.environ.get("RAYGYM_VLLM_PYTHON") or sys.executable)
    a = p.parse_args()
    if not torch.cuda.is_available():
        emit("vlm_gpu_check", skipped="no CUDA device")
        return
    engines = {"sglang": (a.sglang_python, sglang_missing(a.sglang_python)),
               "vllm": (a.vllm_python, vllm_missing(a.vllm_python))}
    for kind, (_, why) in engines.items():
        if why is not None:
            emit(f"vlm_{kind}", skipped=why)
    if all(why is not None for _, why in engines.values()):
        return
    from raygym.builtin.tiny_vlm import materialize_vlm
    from raygym.engine_api.auth import new_engine_api_key, use_engine_api_key

    use_engine_api_key(new_engine_api_key())
    model_path = materialize_vlm(tempfile.mkdtemp(prefix="tiny-vlm-"))
    prompt = ImagePrompt.build(model_path)
    reference = load_vlm(model_path).eval()
    for kind, (python, why) in engines.items():
        if why is None:
            attempt(f"vlm_{kind}", check_engine, kind, python, model_path, prompt, reference)


if __name__ == "__main__":
    main()
