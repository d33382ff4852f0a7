"""The HF reference the engine vision tests compare with, on the builtin tiny Qwen2.5-VL: transformers' own forward
pass (system python, float32) of raygym's widened prompts with the images' pixels at the prompt's pads and
raygym's M-RoPE positions (:mod:`raygym.vision.tokens`), as raygym's server, SGLang and vLLM place them; the test
pictures; and the weight-sync probe's trainer side scored by that reference (shared by
tests/sglang_cpu/test_sglang_vision.py, tests/vllm_cpu/test_vllm_vision.py and tests/rollout/)."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image, ImageDraw

from raygym.builtin.tiny_vlm import IMAGE_PLACEHOLDER, image_token_id
from raygym.vision.images import decode_image
from raygym.vision.tokens import expand_image_pads, mrope_positions

MERGE = 2  # the tiny VLM's spatial merge size: an image of grid (t, h, w) takes t * h * w / 4 tokens


def picture(background: tuple[int, int, int], square: tuple[int, int, int], size: tuple[int, int] = (56, 56),
            box: tuple[int, int, int, int] = (8, 8, 30, 30)) -> Image.Image:
    """A ``size`` image of ``background`` with a rectangle ``box`` of ``square``."""
    image = Image.new("RGB", size, background)
    ImageDraw.Draw(image).rectangle(box, fill=square)
    return image


RED = picture((220, 40, 40), (20, 20, 240))
DARK = picture((0, 0, 0), (255, 255, 255), box=(30, 30, 50, 50))
WIDE = picture((30, 160, 60), (250, 250, 0), size=(90, 40), box=(50, 5, 80, 30))  # grid 1x4x6: 6 tokens, delta < 0


def vlm_prompt(tok: Any, proc: Any, parts: list[str], images: list[Image.Image]) -> list[int]:
    """``parts`` joined by one image placeholder per image, each widened to its image's tokens (raygym's contract)."""
    assert len(parts) == len(images) + 1
    ids = tok.encode(IMAGE_PLACEHOLDER.join(parts))
    grids = proc(images=images)["image_grid_thw"].tolist() if images else []
    return expand_image_pads(ids, image_token=image_token_id(tok), grids=grids, merge=MERGE)


def hf_log_softmax(model: Any, tok: Any, proc: Any, prompt: list[int], output: list[int],
                   images: list[Image.Image], *, after_last: bool = False) -> torch.Tensor:
    """HF's log_softmax (float32) after every token of ``prompt + output`` but the last (``after_last``: the last
    too): the images' pixels at the prompt's pads and the prompt's M-RoPE positions (a generated token: its index
    plus the delta), as raygym's server, SGLang and vLLM place them. (HF's own positions, without
    ``position_ids``, are not M-RoPE's here.) A generated pad is text: HF would take every pad for an image's, so
    then the images' features go in as embeddings at the prompt's pads only."""
    full = prompt + output
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([full])}
    if images:
        processed = proc(images=images, return_tensors="pt")
        pad = image_token_id(tok)
        positions, delta = mrope_positions(prompt, image_token=pad, grids=processed["image_grid_thw"].tolist(),
                                           merge=MERGE)
        positions = [row + [len(prompt) + k + delta for k in range(len(output))] for row in positions]
        kwargs.update(position_ids=torch.tensor(positions)[:, None, :], pixel_values=processed["pixel_values"],
                      image_grid_thw=processed["image_grid_thw"])
        if pad in output:
            with torch.no_grad():
                embeds = model.get_input_embeddings()(kwargs.pop("input_ids"))
                features = torch.cat(model.get_image_features(kwargs.pop("pixel_values"),
                                                              kwargs.pop("image_grid_thw")).pooler_output)
            at = torch.tensor([[t == pad for t in prompt] + [False] * len(output)])
            kwargs["inputs_embeds"] = embeds.masked_scatter(at[..., None], features)
    with torch.no_grad():
        logits = model(**kwargs).logits[0]
        return torch.log_softmax((logits if after_last else logits[:-1]).float(), -1)


def hf_output_logprobs(model: Any, tok: Any, proc: Any, prompt: list[int], output: list[int],
                       images: list[Image.Image]) -> torch.Tensor:
    """HF's log-probs of ``output`` after ``prompt`` with ``images``."""
    lsm = hf_log_softmax(model, tok, proc, prompt, output, images)[len(prompt) - 1:]
    return lsm.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def hf_logprobs(model: Any, tok: Any, proc: Any, prompt: list[int], output: list[int],
                images: list[Image.Image]) -> torch.Tensor:
    """HF's log-probs of every token of ``prompt + output`` from the second on, given the ones before it."""
    full = prompt + output
    return hf_log_softmax(model, tok, proc, prompt, output, images).gather(
        -1, torch.tensor(full[1:])[:, None]).squeeze(-1)


def hf_text_argmax(model: Any, prompt: list[int], steps: int) -> list[int]:
    """HF's greedy ``steps`` tokens after the text ``prompt``."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class ReferenceProbe:
    """The weight-sync probe's trainer side for a test trainer holding the tiny VLM as ``model`` (its tokenizer
    ``tok``, its image processor ``proc``); mixed in before ``LocalTrainer``, whose text-only one it replaces."""

    model: Any
    tok: Any
    proc: Any

    def probe_log_probs(self, prompts: list[list[int]], responses: list[list[int]],
                        images: list[list[str]] | None = None) -> list[list[float]]:
        """What TrainerActor.probe_log_probs returns, with each prompt's images (the probe's image item, PNG data
        URLs), scored by the model in eval mode."""
        out = []
        with torch.no_grad():
            for prompt, response, urls in zip(prompts, responses, images or [[] for _ in prompts], strict=True):
                out.append(hf_output_logprobs(self.model.eval(), self.tok, self.proc, prompt, response,
                                              [decode_image(url) for url in urls]).tolist())
        return out
