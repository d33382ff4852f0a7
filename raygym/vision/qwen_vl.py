"""What raygym reads from a Qwen2-VL-family checkpoint (Qwen2-VL, Qwen2.5-VL): its vision tokens, its image
token id and patch merge, and whether a checkpoint is one at all. Pure: files only.

>>> IMAGE_PLACEHOLDER
'<|vision_start|><|image_pad|><|vision_end|>'
>>> is_vision_checkpoint("/nowhere")
False
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# What a prompt writes where its image goes: raygym widens the pad to one token per merged patch
# (raygym.vision.tokens.expand_image_pads).
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


def image_token_id(tokenizer: Any) -> int:
    """The id of ``<|image_pad|>`` in ``tokenizer``: one per image token in a prompt."""
    return int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))


def checkpoint_config(model_path: str) -> dict[str, Any] | None:
    """The local checkpoint's ``config.json`` (None when there is none)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def is_vision_checkpoint(model_path: str) -> bool:
    """Whether the local HF checkpoint at ``model_path`` is a vision-language model (it has a vision tower)."""
    config = checkpoint_config(model_path)
    return config is not None and "vision_config" in config


def image_layout(model_path: str) -> tuple[int, int]:
    """``(image token id, spatial merge size)`` of the vision-language checkpoint at ``model_path``."""
    config = checkpoint_config(model_path)
    assert config is not None and "vision_config" in config, f"{model_path} is no vision-language checkpoint"
    return int(config["image_token_id"]), int(config["vision_config"].get("spatial_merge_size", 2))


def auto_model_class(config: Any) -> Any:
    """transformers' auto class of a checkpoint's model: ``AutoModelForImageTextToText`` for a config with a
    vision tower (a VLM's is no causal LM to ``AutoModelForCausalLM``), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if "vision_config" in config.to_dict() else AutoModelForCausalLM
