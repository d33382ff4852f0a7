"""raygym: reinforcement-learning post-training of LLMs (GRPO, PPO, DAPO, GSPO, REINFORCE++) on Ray.

Light to import: configuration and presets load without torch or ray; ``train`` and
``TrainResult`` come from ``raygym.run.driver`` on first use.

>>> from raygym import Recipe, presets
>>> presets.qwen3_4b() == Recipe()
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raygym import presets
from raygym.config import (
    DatasetConfig,
    GpuAllocation,
    MetricsConfig,
    ModelConfig,
    Recipe,
    TrainConfig,
)
from raygym.errors import ConfigError, RaygymError, WeightSyncError

if TYPE_CHECKING:
    from raygym.run.driver import TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DatasetConfig",
    "GpuAllocation",
    "MetricsConfig",
    "ModelConfig",
    "RaygymError",
    "Recipe",
    "TrainConfig",
    "TrainResult",
    "WeightSyncError",
    "presets",
    "train",
]

_LAZY_FROM_DRIVER = ("train", "TrainResult")


def __getattr__(name: str) -> Any:
    # train/TrainResult pull in torch and ray: import them only when asked for.
    if name in _LAZY_FROM_DRIVER:
        from raygym.run import driver
        return getattr(driver, name)
    raise AttributeError(f"module 'raygym' has no attribute {name!r}")
