"""Named recipes for the Qwen3 family and a CPU-sized ``tiny`` one, plus the model they expect.

Values come from the reference SDK's per-model recipes (modal-projects/training-gym,
``train_recipes/slime_recipe/qwen3_*.py``), which override the ``Qwen3_4B_Recipe`` defaults that
``Recipe()`` already carries; where a value comes from slime's ``scripts/run-qwen3-*.sh`` instead,
the comment says so. Pure: no torch, no ray.

>>> get_base_recipe(ModelConfig(hf_checkpoint="/models/Qwen3-4B")) == qwen3_4b()
True
>>> get_base_recipe("Qwen/Qwen3-8B") == qwen3_8b()
True
>>> PRESETS["qwen3_30b_a3b"]().total_nodes()
2
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from raygym.builtin import TINY_ARCH, TINY_MODEL
from raygym.config.base import MiB
from raygym.config.recipe import Recipe
from raygym.config.sections import ModelConfig
from raygym.errors import ConfigError

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "default_model",
    "get_base_recipe",
    "get_preset",
    "qwen3_0_6b",
    "qwen3_14b",
    "qwen3_1_7b",
    "qwen3_30b_a3b",
    "qwen3_32b",
    "qwen3_4b",
    "qwen3_8b",
    "tiny",
]


def qwen3_0_6b() -> Recipe:
    """Qwen3-0.6B GRPO on 1 node x 8 GPUs, colocated."""
    return Recipe(rollout_batch_size=24, sglang_mem_fraction_static=0.78, max_tokens_per_gpu=12288)


def qwen3_1_7b() -> Recipe:
    """Qwen3-1.7B GRPO on 1 node x 8 GPUs, colocated."""
    return Recipe(rollout_batch_size=24, sglang_mem_fraction_static=0.78, max_tokens_per_gpu=12288)


def qwen3_4b() -> Recipe:
    """Qwen3-4B GRPO on 1 node x 8 GPUs, colocated: exactly the ``Qwen3_4B_Recipe`` page."""
    return Recipe()


def qwen3_8b() -> Recipe:
    """Qwen3-8B GRPO on 1 node x 8 GPUs, colocated."""
    # rollout_batch_size 8: the reference base recipe's default (the 8B recipe does not override it).
    return Recipe(rollout_batch_size=8, sglang_mem_fraction_static=0.72, max_tokens_per_gpu=6144)


def qwen3_14b() -> Recipe:
    """Qwen3-14B GRPO on 1 node x 8 GPUs with TP2 + sequence parallel, colocated."""
    return Recipe(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        rollout_num_gpus_per_engine=2,
        rollout_batch_size=8,
        sglang_mem_fraction_static=0.7,
        max_tokens_per_gpu=4608,
    )


def qwen3_32b() -> Recipe:
    """Qwen3-32B GRPO on 1 node x 8 GPUs with TP4 + sequence parallel, colocated."""
    return Recipe(
        tensor_model_parallel_size=4,
        sequence_parallel=True,
        rollout_num_gpus_per_engine=4,
        rollout_batch_size=4,
        sglang_mem_fraction_static=0.65,
        max_tokens_per_gpu=4096,
    )


def qwen3_30b_a3b() -> Recipe:
    """Qwen3-30B-A3B (MoE) GRPO, disaggregated on 2 nodes x 8 GPUs: trainer on one, 2 engines x 4 GPUs on the other."""
    return Recipe(
        colocate=False,  # raygym's layout: rollout on a node of its own (the reference runs it colocated)
        rollout_num_gpus=8,
        tensor_model_parallel_size=4,
        sequence_parallel=True,
        expert_model_parallel_size=8,  # slime scripts/run-qwen3-30B-A3B.sh
        rollout_num_gpus_per_engine=4,
        rollout_batch_size=4,
        sglang_mem_fraction_static=0.6,
        max_tokens_per_gpu=4096,
    )


def tiny() -> Recipe:
    """A CPU-sized run of the built-in tiny model on the next-digit task: 1 trainer, 1 engine, minutes."""
    return Recipe(
        actor_num_nodes=1,
        actor_num_gpus_per_node=1,
        colocate=False,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        trainer_backend="torch",
        rollout_engine="raygym",
        rollout_batch_size=16,
        n_samples_per_prompt=8,
        global_batch_size=128,
        rollout_max_response_len=8,
        eval_max_response_len=8,
        lr=2e-3,
        weight_decay=0.0,
        num_rollout=100,
        eval_interval=None,
        save="",  # = <output_dir>/checkpoints
        save_interval=20,
        max_tokens_per_gpu=4096,
        rm_type="next_digit",
        use_fault_tolerance=True,
        rollout_health_check_first_wait=5,
        update_weight_buffer_size=16 * MiB,
    )


def _normalize(name: str) -> str:
    return re.sub(r"[._]", "-", name.strip().lower())


class _Registry(dict[str, Callable[[], Recipe]]):
    """Preset name -> recipe function; lookups accept "qwen3-4b", "qwen3_4b", "Qwen3-4B", "qwen3-0.6b"."""

    def __getitem__(self, name: str) -> Callable[[], Recipe]:
        return super().__getitem__(_normalize(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(_normalize(name))

    def get(  # type: ignore[override]  # keys are normalised, so only str keys are looked up
        self, name: str, default: Callable[[], Recipe] | None = None
    ) -> Callable[[], Recipe] | None:
        return super().get(_normalize(name), default)


PRESETS: dict[str, Callable[[], Recipe]] = _Registry(
    {
        "qwen3-0-6b": qwen3_0_6b,
        "qwen3-1-7b": qwen3_1_7b,
        "qwen3-4b": qwen3_4b,
        "qwen3-8b": qwen3_8b,
        "qwen3-14b": qwen3_14b,
        "qwen3-32b": qwen3_32b,
        "qwen3-30b-a3b": qwen3_30b_a3b,
        "tiny": tiny,
    }
)

# The names presets are shown under (lookups also accept "qwen3_0_6b", "Qwen3-0.6B", ...).
PRESET_NAMES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b", "tiny")
assert [_normalize(n) for n in PRESET_NAMES] == list(PRESETS), "PRESET_NAMES lists every preset, in order"

# Per preset: HF id and the architecture numbers raygym checks (layers, hidden, experts, top-k).
_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0-6b": {"hf_checkpoint": "Qwen/Qwen3-0.6B", "num_layers": 28, "hidden_size": 1024},
    "qwen3-1-7b": {"hf_checkpoint": "Qwen/Qwen3-1.7B", "num_layers": 28, "hidden_size": 2048},
    "qwen3-4b": {"hf_checkpoint": "Qwen/Qwen3-4B", "num_layers": 36, "hidden_size": 2560},
    "qwen3-8b": {"hf_checkpoint": "Qwen/Qwen3-8B", "num_layers": 36, "hidden_size": 4096},
    "qwen3-14b": {"hf_checkpoint": "Qwen/Qwen3-14B", "num_layers": 40, "hidden_size": 5120},
    "qwen3-32b": {"hf_checkpoint": "Qwen/Qwen3-32B", "num_layers": 64, "hidden_size": 5120},
    "qwen3-30b-a3b": {
        "hf_checkpoint": "Qwen/Qwen3-30B-A3B",
        "num_layers": 48,
        "hidden_size": 2048,
        "num_experts": 128,
        "moe_router_topk": 8,
    },
    "tiny": {
        "hf_checkpoint": TINY_MODEL,
        "num_layers": TINY_ARCH["num_hidden_layers"],
        "hidden_size": TINY_ARCH["hidden_size"],
    },
}
# Checkpoint base names that are not "<preset name>[-suffix]".
_ALIASES = {"tiny-qwen3": "tiny"}


def _registered() -> str:
    return ", ".join(PRESET_NAMES)


def get_preset(name: str) -> Recipe:
    """The recipe of preset ``name`` ("qwen3-4b", "qwen3_4b", "tiny", ...); ConfigError for an unknown one."""
    fn = PRESETS.get(name)
    if fn is None:
        raise ConfigError(f"preset={name!r}: unknown; registered presets: {_registered()}")
    return fn()


def default_model(preset_name: str) -> ModelConfig:
    """The model a preset is made for (an HF id, or ``builtin:tiny-qwen3`` for ``tiny``)."""
    key = _normalize(preset_name)
    if key not in _MODELS:
        raise ConfigError(f"preset={preset_name!r}: unknown; registered presets: {_registered()}")
    return ModelConfig(**_MODELS[key])


# What a preset changes when a run turns LoRA on (``lora_rank > 0``) and sets these fields itself nowhere. The
# builtin tiny model is random: its output head is small (init std 0.02) and comes after the final norm, so
# adapters on every other linear layer can hardly move its logits (PEFT's all-linear leaves the output head out);
# on the next-digit task they learn only with an adapter on lm_head too, and a larger lr (measured, 60 steps: all
# linear layers but lm_head at lr 2e-3 or 1e-2, 0.07 -> 0.10; with lm_head at 3e-3, 0.08 -> 0.55).
LORA_OVERRIDES: dict[str, dict[str, Any]] = {
    "tiny": {"lora_target_modules": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head", "lr": 3e-3},
}


def lora_overrides(preset_name: str) -> dict[str, Any]:
    """The recipe fields preset ``preset_name`` sets for a LoRA run (see :data:`LORA_OVERRIDES`).

    >>> lora_overrides("tiny")["lr"], lora_overrides("qwen3-4b")
    (0.003, {})
    """
    return dict(LORA_OVERRIDES.get(_normalize(preset_name), {}))


def preset_name_for(hf_checkpoint: str) -> str | None:
    """The preset matching a checkpoint's base name ("Qwen/Qwen3-4B-Instruct-2507" -> "qwen3-4b"), or None."""
    base = hf_checkpoint.rstrip("/").replace("builtin:", "/").rsplit("/", 1)[-1]
    base = _normalize(base)
    if base in _ALIASES:
        return _ALIASES[base]
    matches = [key for key in PRESETS if base == key or base.startswith(key + "-")]
    return max(matches, key=len) if matches else None


def get_base_recipe(model: ModelConfig | str) -> Recipe:
    """The preset recipe for a checkpoint: a name such as "Qwen/Qwen3-8B", "/models/Qwen3-4B" or
    "builtin:tiny-qwen3", or a ``ModelConfig`` holding one.

    Call it explicitly: a TrainConfig uses the recipe it is given. Raises ConfigError listing the
    registered models for a checkpoint with no preset.
    """
    if isinstance(model, ModelConfig):
        checkpoint = model.hf_checkpoint
    elif isinstance(model, str):
        checkpoint = model
    else:
        raise ConfigError(f"get_base_recipe({model!r}): pass a checkpoint name such as 'Qwen/Qwen3-8B' or a "
                          "ModelConfig")
    name = preset_name_for(checkpoint)
    if name is None:
        models = ", ".join(str(m["hf_checkpoint"]) for m in _MODELS.values())
        raise ConfigError(
            f"hf_checkpoint={checkpoint!r}: no preset for this model; registered models: {models}. "
            "Build a Recipe(...) yourself or start from raygym.presets.qwen3_4b()"
        )
    return PRESETS[name]()
