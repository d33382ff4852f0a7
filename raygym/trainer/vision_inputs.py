"""The extra forward inputs of a vision-language model, for a right-padded micro-batch of samples.

Each sample carries its images as PNG data URLs (``Sample.images``) and its prompt with every image's tokens
already widened. For a micro-batch this builds what ``Qwen2_5_VLForConditionalGeneration`` needs beside the
token ids: ``pixel_values`` and ``image_grid_thw`` of every image in row order (the checkpoint's own image
processor, as the engines run it), and explicit M-RoPE ``position_ids`` ``[3, b, L]``
(:func:`raygym.vision.tokens.mrope_positions`), so the model never falls back on its stateful
``rope_deltas``. Padding positions are 0; they are masked. The images enter as ``inputs_embeds`` built with
:func:`raygym.vision.model_inputs.embed_with_images` at the prompt's image tokens only: a response may hold
the image token too, as a token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from raygym.vision.images import decode_image
from raygym.vision.qwen_vl import image_layout
from raygym.vision.tokens import mrope_positions

CACHE_IMAGES = 1024  # processed images kept: a step's prompts recur in every group member and every pass


class VisionInputs:
    """Forward inputs of the VLM checkpoint at ``model_path`` (its image processor and image token)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token, self.merge = image_layout(model_path)
        self._cache: OrderedDict[str, tuple[torch.Tensor, tuple[int, int, int]]] = OrderedDict()

    def processed(self, url: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``(pixel_values [patches, C*T*P*P], grid (t, h, w))`` of one image."""
        hit = self._cache.get(url)
        if hit is not None:
            self._cache.move_to_end(url)
            return hit
        out = self.processor(images=[decode_image(url)], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        hit = (out["pixel_values"].float(), (t, h, w))
        self._cache[url] = hit
        if len(self._cache) > CACHE_IMAGES:
            self._cache.popitem(last=False)
        return hit

    def forward_kwargs(self, tokens: Sequence[torch.Tensor], prompt_lengths: Sequence[int],
                       images: Sequence[Sequence[str]], width: int, device: torch.device) -> dict[str, Any]:
        """``pixel_values``, ``image_grid_thw``, ``position_ids`` and ``image_mask`` (the prompts' image tokens,
        ``[b, L]``) for rows ``tokens`` right-padded to ``width``; ``{}`` when no row has an image (the model's
        own text positions then apply)."""
        if not any(images):
            return {}
        image_mask = torch.zeros(len(tokens), width, dtype=torch.bool)
        pixels: list[torch.Tensor] = []
        grids: list[tuple[int, int, int]] = []
        positions = torch.zeros(3, len(tokens), width, dtype=torch.int64)
        for row, (ids, urls) in enumerate(zip(tokens, images, strict=True)):
            row_grids = []
            for url in urls:
                values, grid = self.processed(url)
                pixels.append(values)
                row_grids.append(grid)
            rows, _ = mrope_positions(ids.tolist(), image_token=self.image_token, grids=row_grids, merge=self.merge)
            positions[:, row, : len(ids)] = torch.tensor(rows, dtype=torch.int64)
            image_mask[row, : prompt_lengths[row]] = ids[: prompt_lengths[row]] == self.image_token
            grids.extend(row_grids)
        return {"pixel_values": torch.cat(pixels).to(device),
                "image_grid_thw": torch.tensor(grids, dtype=torch.int64, device=device),
                "position_ids": positions.to(device), "image_mask": image_mask.to(device)}
