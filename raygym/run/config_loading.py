"""Building a ``TrainConfig`` from what a user types: ``[--preset NAME] [@ run.toml] [--flag value ...]``
(preset, then TOML files in order, then flags; later wins). The only importer of ``raygym.presets`` in the
config layer: the config classes know no preset. Pure."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from raygym import presets
from raygym.builtin import BUILTIN_PREFIX, is_builtin
from raygym.config.flags import FLAGS, RUN_FIELDS, SECTION_MODELS, SECTIONS, parse_flags
from raygym.config.run import TrainConfig
from raygym.config.schedule import off_policy_defaults, spell_schedule
from raygym.errors import ConfigError

_VALUE_FLAGS = {f"--{s.flag}" for s in FLAGS if s.kind != "bool"} | {"--preset"}


def _split_toml_includes(args: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``@ file.toml`` / ``@file.toml`` includes from flags (values that start with @ stay)."""
    flags: list[str] = []
    files: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token in _VALUE_FLAGS and i + 1 < len(args):
            flags += [token, args[i + 1]]
            i += 2
            continue
        if token == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a TOML file, e.g. '@ run.toml'")
            files.append(args[i + 1])
            i += 2
            continue
        if token.startswith("@"):
            files.append(token[1:])
        else:
            flags.append(token)
        i += 1
    return flags, files


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    """Read a TOML run file (local path or fsspec URL) into ``{section: {field: value}}``.

    Tables ``[recipe] [model] [dataset] [metrics]`` or flat keys; top-level ``preset``,
    ``output_dir`` and ``run_id``.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    import fsspec

    try:
        with fsspec.open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"TOML file {path!r} does not exist; check the path after '@'") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"TOML file {path!r} is not valid TOML: {exc}") from None
    out: dict[str, dict[str, Any]] = {section: {} for section in (*SECTIONS, "preset")}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in ("recipe", "model", "dataset", "metrics") and isinstance(value, dict):
            model = SECTION_MODELS[key]
            for field, item in value.items():
                field = field.replace("-", "_")
                if field not in model.model_fields and not (key == "recipe" and field == "schedule"):
                    close = difflib.get_close_matches(field, list(model.model_fields), n=3)
                    raise ConfigError(
                        f"{path}: [{key}] {field}: not a field of {'Recipe' if key == 'recipe' else model.__name__}"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                    )
                out[key][field] = item
        elif key == "preset":
            out["preset"]["name"] = value
        elif key == "schedule":  # a spelling of the recipe's mode fields (raygym.config.schedule)
            out["recipe"]["schedule"] = value
        elif key in RUN_FIELDS:
            out["run"][key] = value
        else:
            section = next(
                (
                    s
                    for s in ("recipe", "model", "dataset", "metrics")
                    if key in SECTION_MODELS[s].model_fields
                ),
                None,
            )
            if section is None:
                every = [f for s in SECTIONS for f in SECTION_MODELS[s].model_fields]
                close = difflib.get_close_matches(key, every, n=3)
                raise ConfigError(
                    f"{path}: {key}: not a config field"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
            out[section][key] = value
    return out


def load_train_config(args: Sequence[str]) -> TrainConfig:
    """The config a command line describes: ``[--preset NAME] [@ run.toml] [--flag value ...]``, as
    ``raygym train`` reads it. Layers, later wins: the preset (``tiny`` when no preset is given anywhere and
    ``--hf-checkpoint`` is unset or one of the builtin tiny models), then TOML files in order, then flags. Bad input
    raises ConfigError.

    >>> cfg = load_train_config(["--num-rollout", "3"])
    >>> cfg.model.hf_checkpoint, cfg.recipe.num_rollout, cfg.recipe.rm_type
    ('builtin:tiny-qwen3', 3, 'next_digit')
    """
    flag_args, toml_files = _split_toml_includes(list(args))
    layers: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    preset_name: str | None = None
    for path in toml_files:
        loaded = load_toml(path)
        preset_name = loaded["preset"].get("name", preset_name)
        for section in SECTIONS:
            layers[section].update(spell_schedule(loaded[section]) if section == "recipe" else loaded[section])
    flag_preset, flag_layers = parse_flags(flag_args)
    flag_layers["recipe"] = spell_schedule(flag_layers["recipe"])
    preset_name = flag_preset if flag_preset is not None else preset_name
    for section in SECTIONS:
        layers[section].update(flag_layers[section])

    # an off-policy schedule the user asked for turns TIS on unless they set use_tis (the preset's value is no choice)
    layers["recipe"] = off_policy_defaults(layers["recipe"])
    if preset_name is None and is_builtin(layers["model"].get("hf_checkpoint", BUILTIN_PREFIX)):
        preset_name = "tiny"
    if preset_name is not None:
        recipe_values = presets.get_preset(preset_name).field_values()
        if layers["recipe"].get("lora_rank", recipe_values.get("lora_rank", 0)) > 0:  # the preset's LoRA settings
            recipe_values.update(presets.lora_overrides(preset_name))
        layers["recipe"] = {**recipe_values, **layers["recipe"]}
        if "hf_checkpoint" not in layers["model"]:
            layers["model"] = {**presets.default_model(preset_name).field_values(), **layers["model"]}
    return TrainConfig.from_sections(layers)
