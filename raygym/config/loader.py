"""Building a ``TrainConfig`` from what a user types: ``[--preset NAME] [@ run.toml] [--flag value ...]``
(preset, then TOML files in order, then flags; later wins). The only importer of ``raygym.presets``. Pure."""

from __future__ import annotations

import difflib
from typing import Any

from raygym import presets
from raygym.config.flags import _RUN_FIELDS, _SECTION_MODELS, FLAGS, SECTIONS, _cached_parser, _decode_value
from raygym.config.recipe import Recipe
from raygym.config.run import DatasetConfig, MetricsConfig, ModelConfig, TrainConfig
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
            model = _SECTION_MODELS[key]
            for field, item in value.items():
                field = field.replace("-", "_")
                if field not in model.model_fields:
                    close = difflib.get_close_matches(field, list(model.model_fields), n=3)
                    raise ConfigError(
                        f"{path}: [{key}] {field}: not a field of {model.__name__}"
                        + (f" (did you mean {', '.join(close)}?)" if close else "")
                    )
                out[key][field] = item
        elif key == "preset":
            out["preset"]["name"] = value
        elif key in _RUN_FIELDS:
            out["run"][key] = value
        else:
            section = next(
                (
                    s
                    for s in ("recipe", "model", "dataset", "metrics")
                    if key in _SECTION_MODELS[s].model_fields
                ),
                None,
            )
            if section is None:
                every = [f for s in SECTIONS for f in _SECTION_MODELS[s].model_fields]
                close = difflib.get_close_matches(key, every, n=3)
                raise ConfigError(
                    f"{path}: {key}: not a config field"
                    + (f" (did you mean {', '.join(close)}?)" if close else "")
                )
            out[section][key] = value
    return out


# Python 3.11's argparse turns ``--flag=--`` into an empty list: the value travels under this stand-in.
_DOUBLE_DASH = "\x00--"


def config_from_cli_args(args: list[str]) -> TrainConfig:
    flag_args, toml_files = _split_toml_includes(args)
    flag_args = [a[:-2] + _DOUBLE_DASH if a.startswith("--") and a.endswith("=--") else a for a in flag_args]
    parsed = vars(_cached_parser().parse_args(flag_args))
    parsed = {dest: "--" if raw == _DOUBLE_DASH else raw for dest, raw in parsed.items()}
    layers: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    preset_name: str | None = None
    for path in toml_files:
        loaded = load_toml(path)
        preset_name = loaded["preset"].get("name", preset_name)
        for section in SECTIONS:
            layers[section].update(loaded[section])
    preset_name = parsed.pop("__preset", preset_name)
    for dest, raw in parsed.items():
        section, field = dest.split(".", 1)
        spec = next(s for s in FLAGS if s.section == section and s.field == field)
        layers[section][field] = _decode_value(spec, raw) if isinstance(raw, str) else raw

    if preset_name is None and "hf_checkpoint" not in layers["model"]:
        preset_name = "tiny"
    recipe_values: dict[str, Any] = {}
    model_values: dict[str, Any] = {}
    if preset_name is not None:
        recipe_values = presets.get_preset(preset_name).field_values()
        if "hf_checkpoint" not in layers["model"]:
            model_values = presets.default_model(preset_name).field_values()
        if layers["recipe"].get("lora_rank", recipe_values.get("lora_rank", 0)) > 0:  # the preset's LoRA settings
            recipe_values.update(presets.lora_overrides(preset_name))
    return TrainConfig(
        recipe=Recipe(**{**recipe_values, **layers["recipe"]}),
        model=ModelConfig(**{**model_values, **layers["model"]}),
        dataset=DatasetConfig(**layers["dataset"]),
        metrics=MetricsConfig(**layers["metrics"]),
        **layers["run"],
    )
