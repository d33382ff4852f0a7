"""The torch backend on the builtin tiny Qwen2.5-VL (raygym.trainer.vision_inputs): its log-probs are transformers'
own for the prompt with its images (HF computing the M-RoPE positions itself), padded and micro-batched rows
beside a text-only sample included; the image changes them; a train step moves the vision tower and the
language model, or only the language model with ``freeze_params_name_list=['visual']``."""

from __future__ import annotations

import random

import pytest
import torch
from trainer_setup import settings_for

from raygym.builtin.count_shapes import count_shapes_rows
from raygym.builtin.tiny_vlm import image_token_id, materialize_vlm
from raygym.trainer import TrainBatch
from raygym.trainer.torch_backend import TorchBackend
from raygym.types import Sample
from raygym.vision.images import decode_image
from raygym.vision.tokens import expand_image_pads, mrope_positions


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    return materialize_vlm(tmp_path_factory.mktemp("vlm"))


def vlm_samples(path: str, count: int, seed: int = 0, text_only: int = 0) -> list[Sample]:
    """``count`` count-shapes prompts (images widened into their tokens) with random responses, then
    ``text_only`` prompts without an image."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    processor = AutoImageProcessor.from_pretrained(path)
    rng = random.Random(seed)
    samples = []
    for i, row in enumerate(count_shapes_rows(count, seed)):
        grids = processor(images=[decode_image(u) for u in row["images"]])["image_grid_thw"].tolist()
        prompt = expand_image_pads(tok.encode(row["prompt"], add_special_tokens=False),
                                   image_token=image_token_id(tok), grids=grids, merge=processor.merge_size)
        response = [rng.randrange(2, 40) for _ in range(rng.randrange(1, 6))]
        samples.append(Sample(prompt=row["prompt"], prompt_tokens=prompt, group_index=i // 2, sample_index=i % 2,
                              response_tokens=response, reward=float(i % 2), images=list(row["images"])))
    for j in range(text_only):
        samples.append(Sample(prompt="count:", prompt_tokens=tok.encode("count:"), group_index=count // 2 + j,
                              response_tokens=[rng.randrange(2, 40) for _ in range(3)], reward=0.5))
    return samples


def hf_log_probs(path: str, sample: Sample) -> torch.Tensor:
    """transformers' own answer: the processor's pixels, the model computing its own M-RoPE positions (for a
    response without the image token: HF puts image features at every one)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([sample.prompt_tokens + sample.response_tokens])
    extra = {}
    if sample.images:
        processed = AutoImageProcessor.from_pretrained(path)(images=[decode_image(u) for u in sample.images],
                                                             return_tensors="pt")
        extra = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"],
                 "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0].float()
    p = len(sample.prompt_tokens)
    targets = ids[0, p:]
    return torch.log_softmax(logits[p - 1:-1], -1).gather(-1, targets[:, None]).squeeze(-1)


def test_log_probs_are_transformers_own_with_the_images(vlm_path):
    samples = vlm_samples(vlm_path, 4, text_only=1)
    backend = TorchBackend(settings_for(vlm_path, max_tokens_per_gpu=40))  # several micro-batches, padded rows
    backend.init()
    got = backend.compute_log_probs(TrainBatch.from_samples(samples, group_size=1)).log_probs
    for sample, row in zip(samples, got, strict=True):
        torch.testing.assert_close(row, hf_log_probs(vlm_path, sample), atol=1e-5, rtol=1e-5)


def test_the_image_changes_the_log_probs(vlm_path):
    samples = vlm_samples(vlm_path, 2)
    swapped = [Sample(**{**s.__dict__, "images": other.images}) for s, other in zip(samples, samples[::-1], strict=True)]
    assert samples[0].images != samples[1].images and len(samples[0].prompt_tokens) == len(samples[1].prompt_tokens)
    backend = TorchBackend(settings_for(vlm_path))
    backend.init()
    own = backend.compute_log_probs(TrainBatch.from_samples(samples, group_size=2)).log_probs
    other = backend.compute_log_probs(TrainBatch.from_samples(swapped, group_size=2)).log_probs
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(own, other, strict=True))


@pytest.mark.parametrize("frozen", [None, ["visual"]])
def test_a_train_step_moves_the_tower_unless_it_is_frozen(vlm_path, frozen):
    samples = vlm_samples(vlm_path, 8, seed=3)
    backend = TorchBackend(settings_for(vlm_path, lr=1e-2, freeze_params_name_list=frozen))
    backend.init()
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    batch = TrainBatch.from_samples(samples, group_size=2)
    batch = batch.with_log_probs({"log_probs": backend.compute_log_probs(batch).log_probs})
    metrics = backend.train_step(batch.with_advantages("grpo"), rollout_id=0)
    assert metrics["train/loss"] == metrics["train/loss"]  # finite
    moved = {n for n, p in backend.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    tower = {n for n in before if ".visual." in f".{n}"}
    assert tower and any(n.endswith("embed_tokens.weight") for n in moved)
    if frozen:
        assert not moved & tower
    else:
        assert tower & moved


def test_a_response_holding_the_image_token_keeps_it_a_token(vlm_path):
    """A random policy samples ``<|image_pad|>``; the engine embeds it as a token. The trainer must too (HF's
    forward would put image features there, and fail on the count)."""
    from transformers import AutoModelForImageTextToText

    sample = vlm_samples(vlm_path, 1)[0]
    pad = sample.prompt_tokens[sample.prompt_tokens.index(image_token_id_of(vlm_path))]
    with_pad = Sample(**{**sample.__dict__, "response_tokens": [5, pad, 6]})
    without = Sample(**{**sample.__dict__, "response_tokens": [5, 7, 6]})
    backend = TorchBackend(settings_for(vlm_path))
    backend.init()
    got = backend.compute_log_probs(TrainBatch.from_samples([with_pad, without], group_size=2)).log_probs
    torch.testing.assert_close(got[1], hf_log_probs(vlm_path, without), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0][:1], got[1][:1], atol=1e-6, rtol=1e-6)  # same prefix: same log-prob
    # the token after the sampled pad: transformers' forward with the pad embedded as the token it is
    model = AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).eval()
    ids = torch.tensor([with_pad.prompt_tokens + with_pad.response_tokens])
    from transformers import AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(vlm_path)(images=[decode_image(u) for u in sample.images],
                                                             return_tensors="pt")
    embeds = model.get_input_embeddings()(ids)
    features = model.model.get_image_features(processed["pixel_values"], processed["image_grid_thw"]).pooler_output
    prompt_pads = (ids == pad) & (torch.arange(ids.shape[1]) < len(sample.prompt_tokens))
    embeds = embeds.masked_scatter(prompt_pads[..., None], torch.cat(list(features)) if isinstance(features, (list, tuple)) else features)
    grids = processed["image_grid_thw"].tolist()
    rows, _ = mrope_positions(ids[0].tolist(), image_token=pad, grids=grids, merge=2)  # checked against HF above
    with torch.no_grad():
        logits = model(inputs_embeds=embeds, position_ids=torch.tensor(rows)[:, None, :]).logits[0]
    p = len(sample.prompt_tokens)
    want = torch.log_softmax(logits[p + 1], -1)[6]
    torch.testing.assert_close(got[0][2], want, atol=1e-5, rtol=1e-5)


def image_token_id_of(path: str) -> int:
    from transformers import AutoTokenizer

    return image_token_id(AutoTokenizer.from_pretrained(path))


def test_lora_adapts_the_language_model_of_a_vlm(vlm_path):
    """LoRA on the VLM's language model: only adapters train, and a step changes the log-probs of image prompts."""
    samples = vlm_samples(vlm_path, 8, seed=5)
    backend = TorchBackend(settings_for(vlm_path, lr=1e-2, lora_rank=4, lora_alpha=8,
                                        lora_target_modules="q_proj,k_proj,v_proj,o_proj"))
    info = backend.init()
    assert info["lora"]["targets"] == 8  # 4 projections x 2 language-model layers; the vision tower has none
    batch = TrainBatch.from_samples(samples, group_size=2)
    before = backend.compute_log_probs(batch).log_probs
    backend.train_step(batch.with_log_probs({"log_probs": before}).with_advantages("grpo"), rollout_id=0)
    after = backend.compute_log_probs(batch).log_probs
    trained = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n and "visual" not in n for n in trained)
    assert max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True)) > 1e-5
