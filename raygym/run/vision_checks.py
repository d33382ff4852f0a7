"""What a run with images or on a vision-language checkpoint needs, checked before Ray starts (no torch).

>>> from raygym.config import ModelConfig, Recipe, TrainConfig
>>> check_vision_run(TrainConfig(recipe=Recipe(trainer_backend="megatron"),
...                              model=ModelConfig(hf_checkpoint="builtin:tiny-qwen2.5-vl")))
Traceback (most recent call last):
...
raygym.errors.ConfigError: trainer_backend='megatron' with hf_checkpoint='builtin:tiny-qwen2.5-vl' (a vision-language model): raygym's Megatron backend builds Qwen3 and Qwen3-MoE language models only; use --trainer-backend torch
>>> check_vision_model({"image": "images"}, "builtin:tiny-qwen3")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
raygym.errors.ConfigError: multimodal_keys={'image': 'images'} needs a vision-language checkpoint ...
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from raygym.builtin import TINY_VLM_MODEL, is_builtin
from raygym.errors import ConfigError
from raygym.vision.dataset import image_column, text_only_model

if TYPE_CHECKING:
    from raygym.config import TrainConfig

# The engines that generate from images today, and why the others do not.
VISION_ENGINES = ("raygym", "vllm", "sglang")
ENGINE_GAPS: dict[str, str] = {}


def checkpoint_config(hf_checkpoint: str) -> dict[str, Any] | None:
    """The checkpoint's config.json when it can be read without downloading (a local directory, the Hub cache)."""
    path = os.path.expanduser(hf_checkpoint.removeprefix("file://"))
    candidate: str | None = os.path.join(path, "config.json")
    if not os.path.isfile(candidate or ""):
        candidate = None
        if "://" not in hf_checkpoint and not os.path.isabs(path) and hf_checkpoint.count("/") == 1:
            try:
                from huggingface_hub import try_to_load_from_cache

                found = try_to_load_from_cache(hf_checkpoint, "config.json")
                candidate = found if isinstance(found, str) else None
            except (ImportError, ValueError):
                candidate = None
    if candidate is None:
        return None
    try:
        with open(candidate, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_vision_model(hf_checkpoint: str) -> bool | None:
    """True for a vision-language checkpoint (the builtin VLM, or a readable ``config.json`` with a
    ``vision_config``), False for a text model, None when it cannot be told without a download."""
    if is_builtin(hf_checkpoint):
        return hf_checkpoint == TINY_VLM_MODEL
    config = checkpoint_config(hf_checkpoint)
    return None if config is None else "vision_config" in config


def check_vision_model(multimodal_keys: Any, hf_checkpoint: str) -> None:
    """With an image column in ``multimodal_keys``, ``hf_checkpoint`` must be a vision-language model. A
    checkpoint that cannot be read without a download passes here and is checked when the data loads."""
    if image_column(multimodal_keys) is not None and is_vision_model(hf_checkpoint) is False:
        raise text_only_model(hf_checkpoint, multimodal_keys)


def check_vision_run(cfg: TrainConfig) -> None:
    """ConfigError when a vision-language checkpoint meets a backend, engine or layout that cannot run it."""
    ckpt = cfg.model.hf_checkpoint
    if not is_vision_model(ckpt):
        return
    recipe = cfg.recipe
    what = f"hf_checkpoint={ckpt!r} (a vision-language model)"
    if recipe.trainer_backend == "megatron":
        raise ConfigError(f"trainer_backend='megatron' with {what}: raygym's Megatron backend builds Qwen3 and "
                          "Qwen3-MoE language models only; use --trainer-backend torch")
    if recipe.rollout_engine not in VISION_ENGINES:
        raise ConfigError(f"rollout_engine={recipe.rollout_engine!r} with {what}: "
                          f"{ENGINE_GAPS.get(recipe.rollout_engine, 'it generates from text only')}; "
                          "use --rollout-engine raygym")
    if recipe.use_critic:
        raise ConfigError(f"use_critic with {what}: raygym's critic reads token ids only, not images; use a "
                          "critic-free estimator (--advantage-estimator grpo, the default)")
    ranks = recipe.actor_num_nodes * recipe.actor_num_gpus_per_node
    if ranks > 1:
        raise ConfigError(f"actor_num_nodes x actor_num_gpus_per_node = {ranks} trainer ranks with {what}: the torch "
                          "backend embeds a VLM's images outside FSDP's forward, so it trains one on one rank only; "
                          "use --actor-num-nodes 1 --actor-num-gpus-per-node 1")
