"""Command-line flags, one per config field, generated from the models: the table, argv encoding and
decoding, and the parser (``--x``/``--no-x`` booleans, ``--no-x`` = None, JSON dicts and lists, custom
functions as import paths). Pure."""

from __future__ import annotations

import argparse
import functools
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from pydantic import BaseModel

from raygym.callables import callable_import_path
from raygym.config.constants import RECIPE_CHOICES
from raygym.config.recipe_fields import RecipeFields
from raygym.config.schedule import SCHEDULE_NAMES
from raygym.config.sections import DatasetConfig, MetricsConfig, ModelConfig, RunLocation
from raygym.errors import ConfigError

SECTIONS = ("recipe", "model", "dataset", "metrics", "run")
# The model declaring each section's fields ("run": TrainConfig's own fields, besides the sections).
SECTION_MODELS: dict[str, type[BaseModel]] = {
    "recipe": RecipeFields,
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "metrics": MetricsConfig,
    "run": RunLocation,
}
RUN_FIELDS = tuple(RunLocation.model_fields)


class _FlagSpec(typing.NamedTuple):
    section: str
    field: str
    flag: str  # without the leading "--"
    kind: str  # "bool" | "int" | "float" | "str" | "json" | "function"
    optional: bool
    help: str


def _classify(annotation: Any) -> tuple[str, bool]:
    """(kind, optional) of a field's annotation."""
    origin = typing.get_origin(annotation)
    members = typing.get_args(annotation) if origin in (Union, types.UnionType) else (annotation,)
    optional = type(None) in members
    rest = [m for m in members if m is not type(None)]
    if any(typing.get_origin(m) is Callable or m is Callable for m in rest):
        return "function", optional
    if len(rest) == 1 and rest[0] in (bool, int, float, str):
        return rest[0].__name__, optional
    return "json", optional


def _build_flag_table() -> list[_FlagSpec]:
    specs: list[_FlagSpec] = []
    taken: set[str] = set()
    for section in SECTIONS:
        model = SECTION_MODELS[section]
        for field in model.model_fields:
            info = model.model_fields[field]
            kind, optional = _classify(info.annotation)
            flag = field.replace("_", "-")
            if flag in taken:  # same name in two sections: the later one is prefixed
                flag = f"{section}-{flag}"
            if kind == "bool" and optional:
                raise TypeError(f"{section}.{field}: optional booleans have no flag form")
            specs.append(_FlagSpec(section, field, flag, kind, optional, info.description or ""))
            taken.add(flag)
    every = [s.flag for s in specs] + [f"no-{s.flag}" for s in specs if s.kind == "bool" or s.optional]
    if len(every) != len(set(every)):
        raise TypeError(
            "generated flags collide: " + ", ".join(sorted({f for f in every if every.count(f) > 1}))
        )
    return specs


FLAGS: list[_FlagSpec] = _build_flag_table()
_FLAG_BY_NAME = {spec.flag: spec for spec in FLAGS}


def _encode_value(spec: _FlagSpec, value: Any) -> str:
    if spec.kind == "json":
        return json.dumps(value, sort_keys=True)
    if spec.kind == "function":
        return callable_import_path(value, spec.field)
    if spec.kind == "float":
        return repr(float(value))
    return str(value)


def encode_section(section: str, obj: BaseModel) -> list[str]:
    args: list[str] = []
    for spec in FLAGS:
        if spec.section != section:
            continue
        value = getattr(obj, spec.field)
        if spec.kind == "bool":
            args.append(f"--{spec.flag}" if value else f"--no-{spec.flag}")
        elif value is None:
            args.append(f"--no-{spec.flag}")
        else:
            text = _encode_value(spec, value)
            # Values that look like flags or TOML includes travel glued to their flag.
            args += [f"--{spec.flag}={text}"] if text.startswith(("-", "@")) else [f"--{spec.flag}", text]
    return args


def decode_value(spec: _FlagSpec, text: str) -> Any:
    """A flag's text as its field's value (ConfigError naming the flag when it is not one)."""
    try:
        if spec.kind == "int":
            if not re.fullmatch(r"[+-]?\d+", text.strip()):
                raise ValueError("not a whole number")
            return int(text)
        if spec.kind == "float":
            return float(text)
        if spec.kind == "json":
            if (
                spec.field == "apply_chat_template_kwargs"
                and spec.section == "recipe"
                and not text.startswith(("{", '"'))
            ):
                return text  # a bare JSON string of kwargs is kept as written
            return json.loads(text)
    except ValueError as exc:
        expected = {"int": "a whole number", "float": "a number", "json": "JSON"}[spec.kind]
        raise ConfigError(f"{spec.field}={text!r}: --{spec.flag} expects {expected} ({exc})") from None
    return text


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message}; run with --help for the flags")


def build_arg_parser(prog: str = "raygym train") -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (its values land as raw strings)."""
    parser = _RaisingParser(prog=prog, allow_abbrev=False, add_help=False, argument_default=argparse.SUPPRESS)
    parser.add_argument(
        "--preset", dest="__preset", metavar="NAME", help="Base recipe (see raygym.presets.PRESETS)."
    )
    parser.add_argument(
        "--schedule", dest="__schedule", metavar="NAME", choices=SCHEDULE_NAMES,
        help="How generation and training interleave: 'sync' (default), 'one_step_off' (= --async-mode) or "
             "'fully_async' (= --fully-async; see --max-staleness, --stale-sample-policy).",
    )
    titles = {"recipe": "recipe", "model": "model", "dataset": "dataset", "metrics": "metrics", "run": "run"}
    for section in SECTIONS:
        group = parser.add_argument_group(titles[section])
        for spec in (s for s in FLAGS if s.section == section):
            dest = f"{spec.section}.{spec.field}"
            choices = RECIPE_CHOICES.get(spec.field) if spec.section == "recipe" else None
            extra = f" Choices: {', '.join(map(repr, choices))}." if choices else ""
            if spec.kind == "bool":
                group.add_argument(
                    f"--{spec.flag}", dest=dest, action="store_const", const=True, help=spec.help + extra
                )
                group.add_argument(
                    f"--no-{spec.flag}", dest=dest, action="store_const", const=False, help=argparse.SUPPRESS
                )
                continue
            metavar = {"json": "JSON", "function": "PKG.MOD:FN"}.get(spec.kind, spec.kind.upper())
            group.add_argument(f"--{spec.flag}", dest=dest, metavar=metavar, help=spec.help + extra)
            if spec.optional:
                group.add_argument(
                    f"--no-{spec.flag}", dest=dest, action="store_const", const=None, help=argparse.SUPPRESS
                )
    return parser


@functools.lru_cache(maxsize=1)
def _cached_parser() -> argparse.ArgumentParser:
    return build_arg_parser()


# Python 3.11's argparse turns ``--flag=--`` into an empty list: the value travels under this stand-in.
_DOUBLE_DASH = "\x00--"
_FLAG_BY_DEST = {f"{spec.section}.{spec.field}": spec for spec in FLAGS}


def parse_flags(args: list[str]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """``--preset``'s value (None without one) and ``{section: {field: value}}`` of the flags ``args``
    (flags only: :mod:`raygym.run.config_loading` takes ``@ run.toml`` includes out first). ConfigError for an
    unknown flag or a bad value.

    >>> preset, sections = parse_flags(["--lr", "2e-6", "--no-colocate", "--run-id", "r1"])
    >>> preset, sections["recipe"], sections["run"]
    (None, {'lr': 2e-06, 'colocate': False}, {'run_id': 'r1'})
    """
    args = [a[:-2] + _DOUBLE_DASH if a.startswith("--") and a.endswith("=--") else a for a in args]
    parsed = vars(_cached_parser().parse_args(args))
    parsed = {dest: "--" if raw == _DOUBLE_DASH else raw for dest, raw in parsed.items()}
    preset: str | None = parsed.pop("__preset", None)
    sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    if "__schedule" in parsed:  # a spelling of the recipe's mode fields (raygym.config.schedule)
        sections["recipe"]["schedule"] = parsed.pop("__schedule")
    for dest, raw in parsed.items():
        spec = _FLAG_BY_DEST[dest]
        sections[spec.section][spec.field] = decode_value(spec, raw) if isinstance(raw, str) else raw
    return preset, sections


def format_cli_help(prog: str = "raygym train") -> str:
    """Help text for every flag (booleans also take ``--no-x``; optional fields take ``--no-x`` for None)."""
    return build_arg_parser(prog).format_help()
