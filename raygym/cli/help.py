"""``raygym train --help`` / ``raygym plan --help``: every flag with its default (and the tiny preset's
value where it differs), the choices of the fields that have them, the presets and the ``@ run.toml``
syntax. Pure: no torch, no ray.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raygym.config import (
    FLAGS,
    RM_TYPES,
    TASK_RM_TYPES,
    DatasetConfig,
    MetricsConfig,
    ModelConfig,
    Recipe,
    TrainConfig,
    build_arg_parser,
)

_MODELS: dict[str, type[BaseModel]] = {
    "recipe": Recipe, "model": ModelConfig, "dataset": DatasetConfig, "metrics": MetricsConfig, "run": TrainConfig,
}
_EXTRA_CHOICES = {("recipe", "rm_type"): RM_TYPES + TASK_RM_TYPES}


def _shown(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _default_of(model: type[BaseModel], field: str) -> Any:
    info = model.model_fields[field]
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def describe_usage(prog: str) -> str:
    """The text above the flags: usage, how settings layer, the presets and how values are written."""
    from raygym.presets import PRESET_NAMES

    return (
        f"usage: {prog} [--preset NAME] [@ run.toml ...] [--flag VALUE ...]\n\n"
        "Settings apply in this order, a later one wins: the preset, then each TOML file given as\n"
        "'@ run.toml' or '@run.toml' (tables [recipe] [model] [dataset] [metrics] or flat keys; top-level\n"
        "preset, output_dir, run_id), then the flags. Without --preset or --hf-checkpoint the tiny preset\n"
        "(built-in model and task, CPU) is used.\n"
        f"Presets: {', '.join(PRESET_NAMES)}.\n"
        "Booleans: --x / --no-x. Optional fields: --no-x sets None. Dicts and lists: JSON. Functions:\n"
        "pkg.module:function. Defaults are Recipe()'s (the Qwen3-4B recipe); 'tiny:' gives the tiny\n"
        "preset's value where it differs. Steps are numbered from 0 (metrics.jsonl, iter_*, the console).\n"
    )


def cli_help(prog: str = "raygym train") -> str:
    """The full help text of ``train`` / ``plan``."""
    from raygym.presets import PRESET_NAMES, default_model, tiny

    parser = build_arg_parser(prog)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = argparse.SUPPRESS
    parser.description = describe_usage(prog)
    tiny_values = {"recipe": tiny().field_values(), "model": default_model("tiny").field_values()}
    by_dest = {f"{spec.section}.{spec.field}": spec for spec in FLAGS}
    for action in parser._actions:
        if action.dest == "__preset":
            action.help = f"Base recipe: {', '.join(PRESET_NAMES)}."
            continue
        spec = by_dest.get(action.dest)
        if spec is None or action.help in (None, argparse.SUPPRESS):
            continue
        default = _default_of(_MODELS[spec.section], spec.field)
        parts = ["required" if default is PydanticUndefined else f"default: {_shown(default)}"]
        preset = tiny_values.get(spec.section, {})
        if spec.field in preset and (default is PydanticUndefined or preset[spec.field] != default):
            parts.append(f"tiny: {_shown(preset[spec.field])}")
        if spec.kind == "bool":
            parts.append(f"--no-{spec.flag} to turn off")
        elif spec.optional:
            parts.append(f"--no-{spec.flag} for None")
        help_text = action.help
        choices = _EXTRA_CHOICES.get((spec.section, spec.field))
        if choices and "Choices:" not in help_text:
            help_text += f" Choices: {', '.join(map(repr, choices))}."
        action.help = f"{help_text} ({'; '.join(parts)})".replace("%", "%%")
    return parser.format_help()
