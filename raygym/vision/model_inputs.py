"""A Qwen2-VL-family model's input embeddings with its images in place (torch; the trainer and raygym's server).

HF's own forward puts image features at every ``<|image_pad|>`` of ``input_ids``; a response the policy sampled
may hold that token too (a random model does), and there it must stay a token embedding, as the engine that
generated it embedded it. Passing ``inputs_embeds`` built here, with the features at the prompt's pads only,
gives HF's values for the prompt and the engine's for the response.
"""

from __future__ import annotations

from typing import Any

import torch


def embed_with_images(model: Any, input_ids: torch.Tensor, image_mask: torch.Tensor, pixel_values: torch.Tensor,
                      image_grid_thw: torch.Tensor) -> torch.Tensor:
    """``input_ids`` embedded, with the vision tower's features of the images (in order) at ``image_mask``, as
    HF's Qwen2-VL forward places them; other image pads (generated ones) stay token embeddings."""
    embeds = model.get_input_embeddings()(input_ids)
    out = model.get_image_features(pixel_values, image_grid_thw)
    features = getattr(out, "pooler_output", out)  # transformers 5: an output object; 4.x: the split tensors
    if isinstance(features, (list, tuple)):
        features = torch.cat(list(features))
    features = features.to(embeds.device, embeds.dtype)
    if int(image_mask.sum()) != features.shape[0]:
        raise ValueError(f"{int(image_mask.sum())} image token(s) for {features.shape[0]} image feature(s)")
    return embeds.masked_scatter(image_mask[..., None], features)
