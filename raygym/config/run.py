"""``TrainConfig``: all of a run (the recipe, the model, the data, the metric sinks, where it writes), and its
exact flag form (``cli_args`` / ``from_cli_args``). The sections besides the recipe live in
:mod:`raygym.config.sections` (re-exported here). Pure.

>>> cfg = TrainConfig(model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"), output_dir="/tmp/run1")
>>> cfg.run_dir
'/tmp/run1'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Self

from pydantic import ValidationError, model_validator

from raygym.callables import callable_import_path
from raygym.config.base import config_error_from, option, option_factory, parse_json_object
from raygym.config.constants import CUSTOM_FUNCTION_FIELDS
from raygym.config.flags import SECTIONS, encode_section, parse_flags
from raygym.config.recipe import Recipe
from raygym.config.sections import DatasetConfig, MetricsConfig, ModelConfig, RunLocation, new_run_id
from raygym.errors import ConfigError

__all__ = ["DatasetConfig", "MetricsConfig", "ModelConfig", "RunLocation", "TrainConfig", "new_run_id"]


class TrainConfig(RunLocation):
    """Everything a run needs. ``run_id`` is minted once, at construction, and kept.

    >>> cfg = TrainConfig(model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"), output_dir="/tmp/run1")
    >>> cfg.run_dir, cfg.checkpoint_dir
    ('/tmp/run1', '/checkpoints')
    """

    recipe: Recipe = option_factory(Recipe, "The training recipe.")
    model: ModelConfig = option(..., "The policy model.")
    dataset: DatasetConfig = option_factory(DatasetConfig, "The prompt data.")
    metrics: MetricsConfig = option_factory(MetricsConfig, "Metric sinks besides metrics.jsonl.")

    def __init__(self, **data: Any) -> None:
        if data.get("run_id") is None:
            data.pop("run_id", None)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error_from(exc, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        if isinstance(obj, dict) and obj.get("run_id") is None:
            obj = {k: v for k, v in obj.items() if k != "run_id"}
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise config_error_from(exc, cls) from None

    @model_validator(mode="after")
    def _validate(self) -> TrainConfig:
        self.recipe.validate_model_parallelism(self.model)
        self.recipe.check_trainer_backend()
        return self

    @property
    def run_dir(self) -> str:
        """Where the run writes: ``output_dir``, or ``runs/<run_id>``."""
        return self.output_dir if self.output_dir else f"runs/{self.run_id}"

    @property
    def checkpoint_dir(self) -> str:
        """``recipe.save``, or ``<run_dir>/checkpoints`` when it is empty."""
        return self.recipe.save or f"{self.run_dir.rstrip('/')}/checkpoints"

    def chat_template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template kwargs: the recipe's (dict or JSON), updated by the dataset's."""
        base = self.recipe.apply_chat_template_kwargs
        merged = (
            parse_json_object("apply_chat_template_kwargs", base) if isinstance(base, str) and base else {}
        )
        if isinstance(base, dict):
            merged = dict(base)
        return {**merged, **self.dataset.apply_chat_template_kwargs}

    def to_json_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (custom functions as import paths); ``model_validate`` reads it back."""
        recipe = self.recipe.field_values()
        for field in CUSTOM_FUNCTION_FIELDS:
            if recipe[field] is not None:
                try:
                    recipe[field] = callable_import_path(recipe[field], field)
                except ConfigError:
                    recipe[field] = f"<unimportable {recipe[field]!r}>"
        json_safe: dict[str, Any] = json.loads(
            json.dumps(
                {
                    "recipe": recipe,
                    "model": self.model.model_dump(),
                    "dataset": self.dataset.model_dump(),
                    "metrics": self.metrics.model_dump(),
                    "output_dir": self.output_dir,
                    "run_id": self.run_id,
                }
            )
        )
        return json_safe

    def cli_args(self) -> list[str]:
        """Every field as slime-style kebab flags; ``TrainConfig.from_cli_args`` reads them back exactly.

        Booleans are ``--x``/``--no-x``, None is ``--no-x`` (optional fields), dicts and lists are
        JSON, custom functions are import paths (a lambda raises ConfigError).
        """
        args: list[str] = []
        for section in SECTIONS:
            args += encode_section(section, self if section == "run" else getattr(self, section))
        return args

    @classmethod
    def from_cli_args(cls, args: Sequence[str]) -> TrainConfig:
        """Read back what :meth:`cli_args` writes: flags only, every field not given at its default, so
        ``TrainConfig.from_cli_args(cfg.cli_args()) == cfg``. Bad input raises ConfigError.

        A command line as users type it (``--preset``, ``@ run.toml``, the tiny preset when no model is given)
        is read by :func:`raygym.run.config_loading.load_train_config`, as ``raygym train`` does.
        """
        preset, sections = parse_flags(list(args))
        if preset is not None or "hf_checkpoint" not in sections["model"]:
            given = f"--preset {preset}" if preset is not None else "no --hf-checkpoint"
            raise ConfigError(
                f"{given}: TrainConfig.from_cli_args reads the flags cli_args() writes and applies no preset; "
                "pass --hf-checkpoint, or read the command line with raygym.run.config_loading.load_train_config (presets, "
                "TOML files, the tiny preset when no model is given), as `raygym train` does"
            )
        return cls.from_sections(sections)

    @classmethod
    def from_sections(cls, sections: Mapping[str, Mapping[str, Any]]) -> TrainConfig:
        """A config from ``{section: {field: value}}`` (the form flags and TOML files are read into; every
        section of :data:`raygym.config.flags.SECTIONS` present, ``"run"`` holding ``output_dir`` / ``run_id``).
        """
        return cls(
            recipe=Recipe(**sections["recipe"]),
            model=ModelConfig(**sections["model"]),
            dataset=DatasetConfig(**sections["dataset"]),
            metrics=MetricsConfig(**sections["metrics"]),
            **sections["run"],
        )
