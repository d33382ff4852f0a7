"""``builtin:tiny-qwen2.5-vl``: a random Qwen2.5-VL small enough to train on two CPU cores, with its processor.

The language model is the builtin character model's size (hidden 64, two layers) with head size 32, which
vLLM's CPU attention takes, and M-RoPE sections over its 16 rotary pairs. The vision tower is two blocks of
width 32 with Qwen2.5-VL's 14-pixel patches merged 2x2, so a 56x56 image is 16 patches and 4 image tokens.
The tokenizer is the builtin character tokenizer plus Qwen's three vision tokens; the image processor is
transformers' Qwen2-VL one, scaling every image to about 56x56 pixels (its aspect kept). raygym widens each image's pad token itself
(:mod:`raygym.vision.tokens`), so it needs no ``Qwen2_5_VLProcessor`` (whose video half wants torchvision).

The checkpoint is written with ``save_pretrained``, so its tensor names are the ones SGLang and vLLM load
(``model.layers.*``, ``visual.*``, ``lm_head``).

>>> import tempfile
>>> path = materialize_vlm(tempfile.mkdtemp())
>>> from transformers import AutoImageProcessor, AutoTokenizer
>>> from PIL import Image
>>> out = AutoImageProcessor.from_pretrained(path)(images=[Image.new("RGB", (56, 56)), Image.new("RGB", (90, 40))])
>>> out["image_grid_thw"].tolist(), tuple(out["pixel_values"].shape)
([[1, 4, 4], [1, 4, 6]], (40, 1176))
>>> image_token_id(AutoTokenizer.from_pretrained(path)) > 0
True
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from raygym.builtin.chars import build_tokenizer
from raygym.builtin.files import write_model_dir
from raygym.vision.qwen_vl import (
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    image_token_id,
    is_vision_checkpoint,
)

__all__ = ["IMAGE_PAD", "IMAGE_PLACEHOLDER", "IMAGE_SIDE", "TINY_VLM", "VISION_END", "VISION_START", "build_image_processor",
           "build_tiny_vlm", "build_vlm_tokenizer", "image_token_id", "is_vision_checkpoint", "materialize_vlm"]

TINY_VLM = "builtin:tiny-qwen2.5-vl"
IMAGE_SIDE = 56  # pixels: 4x4 patches of 14, merged 2x2 into 4 tokens

TINY_VLM_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},  # temporal, height, width pairs: 16 = 32 / 2
    "tie_word_embeddings": False,
}
TINY_VLM_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,  # the language model's width
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "in_channels": 3,
}


def build_vlm_tokenizer():
    """The builtin character tokenizer with Qwen's vision tokens appended as special tokens."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    return tok


def build_image_processor():
    """transformers' Qwen2-VL image processor (its PIL flavour: no torchvision), scaling images to about 56x56."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


def build_tiny_vlm(seed: int = 0, **text_overrides: Any):
    """``(model, tokenizer)``: a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` (about 0.16M
    parameters, deterministic in ``seed``) and its tokenizer."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = build_vlm_tokenizer()
    image = int(tok.convert_tokens_to_ids(IMAGE_PAD))
    text = {**TINY_VLM_TEXT, "vocab_size": len(tok), "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1,
            **text_overrides}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(TINY_VLM_VISION), image_token_id=image,
                              video_token_id=image, vision_start_token_id=int(tok.convert_tokens_to_ids(VISION_START)),
                              vision_end_token_id=int(tok.convert_tokens_to_ids(VISION_END)))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model, tok


def materialize_vlm(directory: str | os.PathLike, seed: int = 0) -> str:
    """Write ``builtin:tiny-qwen2.5-vl`` (weights, config, tokenizer, processor) under ``directory`` once and
    return its path."""
    path = Path(directory) / f"tiny-qwen2.5-vl-seed{seed}"
    if (path / "preprocessor_config.json").exists():
        return str(path)
    model, tokenizer = build_tiny_vlm(seed)

    def processor_files(tmp: Path) -> None:
        build_image_processor().save_pretrained(tmp)
        # the engines build Qwen2.5-VL's processor (tokenizer, image and video processors) from these files
        preprocessor = tmp / "preprocessor_config.json"
        preprocessor.write_text(json.dumps({**json.loads(preprocessor.read_text()),
                                            "processor_class": "Qwen2_5_VLProcessor"}, indent=2))

    return write_model_dir(path, model, [tokenizer.save_pretrained, processor_files])
