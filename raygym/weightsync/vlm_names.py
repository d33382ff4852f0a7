"""A vision-language model's weights under the names each engine kind loads, converted at the sender (pure).

The torch backend trains transformers' in-memory Qwen2-VL-family model, whose names nest the language model and
the vision tower (``model.language_model.*``, ``model.visual.*``); its checkpoint files name them ``model.*`` and
``visual.*``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# A vision-language model's in-memory name prefixes (transformers' Qwen2-VL family: ``model.language_model.*``,
# ``model.visual.*``) and its checkpoint's (``model.*``, ``visual.*``); ``lm_head.*`` is the same in both.
VLM_CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# Engine kinds whose loaders take a vision-language model's checkpoint names only. Stock SGLang's
# ``Qwen2_5_VLForConditionalGeneration.load_weights`` (0.5.18) looks names up as its own parameters (``model.layers.*``,
# ``visual.*``): an in-memory name of a stacked tensor (q/k/v, gate/up) raises KeyError, every other one is skipped
# without a word. raygym's server and vLLM (its model's ``hf_to_vllm_mapper``) take both names.
CHECKPOINT_NAME_ENGINES = frozenset({"sglang"})


def checkpoint_name(name: str) -> str:
    """The checkpoint name of an in-memory HF name (a vision-language model's language model and vision tower);
    every other name unchanged.

    >>> checkpoint_name("model.language_model.layers.0.self_attn.q_proj.weight"), checkpoint_name("model.visual.merger.ln_q.weight")
    ('model.layers.0.self_attn.q_proj.weight', 'visual.merger.ln_q.weight')
    >>> checkpoint_name("model.layers.0.mlp.up_proj.weight"), checkpoint_name("lm_head.weight")
    ('model.layers.0.mlp.up_proj.weight', 'lm_head.weight')
    """
    for inner, outer in VLM_CHECKPOINT_PREFIXES:
        if name.startswith(inner):
            return outer + name[len(inner):]
    return name


def names_for_engine(weights: Iterable[tuple[str, Any]], kind: str) -> Iterable[tuple[str, Any]]:
    """``weights`` (HF names, as the trainer holds them) under the names engine kind ``kind`` loads: the checkpoint's
    for the kinds in :data:`CHECKPOINT_NAME_ENGINES`, unchanged for the others.

    >>> list(names_for_engine([("model.visual.blocks.0.attn.qkv.weight", 1)], "sglang"))
    [('visual.blocks.0.attn.qkv.weight', 1)]
    >>> list(names_for_engine([("model.visual.blocks.0.attn.qkv.weight", 1)], "raygym"))
    [('model.visual.blocks.0.attn.qkv.weight', 1)]
    """
    if kind not in CHECKPOINT_NAME_ENGINES:
        return weights
    return ((checkpoint_name(name), tensor) for name, tensor in weights)
