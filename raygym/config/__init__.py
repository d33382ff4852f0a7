"""Typed configuration: ``Recipe`` (how to train), ``ModelConfig``, ``DatasetConfig``, ``MetricsConfig``
and ``TrainConfig`` (all of it, plus where the run writes).

Field names and defaults follow the ``Qwen3_4B_Recipe`` reference page; raygym's own fields are
listed in ``docs/internals.md``. Every invalid value raises :class:`raygym.errors.ConfigError` (a
``ValueError``) naming the field, the value and the fix, before any Ray resource is requested.

Pure: imports neither torch nor ray, so validation and ``raygym plan`` run anywhere.

>>> r = Recipe(rollout_batch_size=32)
>>> r.gpu_allocation().rollout_engines, r.total_nodes(), r.data_parallel_size()
(8, 1, 8)
>>> cfg = TrainConfig(recipe=r, model=ModelConfig(hf_checkpoint="Qwen/Qwen3-4B"))
>>> TrainConfig.from_cli_args(cfg.cli_args()) == cfg
True

A command line as users type it (``--preset``, ``@ run.toml``, the tiny preset without a model) is read by
:func:`raygym.run.config_loading.load_train_config` (above both this package and :mod:`raygym.presets`); the
config classes themselves know no preset.
"""

from __future__ import annotations

from raygym.callables import callable_import_path, load_callable
from raygym.config.allocation import GpuAllocation
from raygym.config.base import CustomFunction, MiB, megatron_installed
from raygym.config.constants import CUSTOM_FUNCTION_FIELDS, RM_TYPES, TASK_RM_TYPES
from raygym.config.flags import FLAGS, build_arg_parser, format_cli_help
from raygym.config.recipe import Recipe
from raygym.config.run import DatasetConfig, MetricsConfig, ModelConfig, TrainConfig, new_run_id
from raygym.errors import ConfigError

__all__ = [
    "CUSTOM_FUNCTION_FIELDS",
    "FLAGS",
    "RM_TYPES",
    "TASK_RM_TYPES",
    "ConfigError",
    "CustomFunction",
    "DatasetConfig",
    "GpuAllocation",
    "MetricsConfig",
    "MiB",
    "ModelConfig",
    "Recipe",
    "TrainConfig",
    "build_arg_parser",
    "callable_import_path",
    "format_cli_help",
    "load_callable",
    "megatron_installed",
    "new_run_id",
]
