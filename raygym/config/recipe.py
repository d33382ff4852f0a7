"""``Recipe``: how to train. Flat, with the ``Qwen3_4B_Recipe`` reference page's field names and defaults,
plus raygym's own fields (listed in ``docs/internals.md``); the fields are declared in
:mod:`raygym.config.recipe_fields`, the rules in :mod:`raygym.config.recipe_checks`. Pure.

>>> r = Recipe(rollout_batch_size=32)
>>> r.gpu_allocation().rollout_engines, r.total_nodes(), r.data_parallel_size()
(8, 1, 8)
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from raygym.callables import callable_identity
from raygym.config import recipe_checks
from raygym.config.constants import CUSTOM_FUNCTION_FIELDS
from raygym.config.flags import encode_section
from raygym.config.recipe_fields import RecipeFields
from raygym.config.schedule import Schedule, Sync, off_policy_defaults, schedule_of, spell_schedule
from raygym.config.sections import ModelConfig


class Recipe(RecipeFields):
    """How to train: cluster shape, algorithm, rollout, optimisation, checkpoints, weight sync.

    Flat, with the ``Qwen3_4B_Recipe`` reference page's field names and defaults (so ``Recipe()``
    is the Qwen3-4B recipe: 1 node x 8 GPUs, colocated), plus raygym's own fields. ``extra_config``
    keys override the same-named fields. Building one checks every rule.

    >>> Recipe(colocate=False).gpu_allocation().total_nodes
    2
    """

    @model_validator(mode="before")
    @classmethod
    def _spell_schedule(cls, data: Any) -> Any:
        """``schedule=`` (a name or a :data:`~raygym.config.schedule.Schedule`) is a spelling of the flat fields;
        an off-policy schedule turns TIS on unless ``use_tis`` is given (:func:`off_policy_defaults`)."""
        return off_policy_defaults(spell_schedule(data)) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _validate(self) -> Recipe:
        recipe_checks.validate_recipe(self)
        return self

    @property
    def schedule(self) -> Schedule:
        """How generation and training interleave, typed (:mod:`raygym.config.schedule`).

        >>> Recipe(colocate=False, schedule="fully_async").schedule
        FullyAsync(max_staleness=2, stale_sample_policy='regenerate')
        >>> Recipe(colocate=False, async_mode=True).schedule.name
        'one_step_off'
        """
        return schedule_of(async_mode=self.async_mode, fully_async=self.fully_async,
                           max_staleness=self.max_staleness, stale_sample_policy=self.stale_sample_policy)

    @property
    def engines_overlap_training(self) -> bool:
        """Whether engines generate while the trainer trains: an asynchronous schedule on engines of their own
        (colocated engines are released while the trainer trains).

        >>> Recipe(colocate=False, rollout_num_gpus=8, async_mode=True).engines_overlap_training, Recipe().engines_overlap_training
        (True, False)
        """
        return not isinstance(self.schedule, Sync) and not self.colocate

    @property
    def engine_cores(self) -> int:
        """CPU cores the engines of a node decode on while the trainer trains (:attr:`engines_overlap_training`):
        ``cpu_engine_cores``, else one per engine.

        >>> two = Recipe(actor_num_gpus_per_node=2, colocate=False, rollout_num_gpus=2, async_mode=True)
        >>> two.engine_cores, two.replace(cpu_engine_cores=3).engine_cores
        (2, 3)
        """
        return self.cpu_engine_cores or max(1, self.gpu_allocation().rollout_engines)

    def model_parallel_requests(self) -> list[str]:
        """``field=value`` of every model-parallel setting asked for (sizes > 1, ``sequence_parallel``): only
        the Megatron backend runs them (see :func:`raygym.config.recipe_checks.model_parallel_requests`).

        >>> Recipe(tensor_model_parallel_size=2, sequence_parallel=True).model_parallel_requests()
        ['tensor_model_parallel_size=2', 'sequence_parallel=True']
        """
        return recipe_checks.model_parallel_requests(self)

    def check_trainer_backend(self, *, megatron_installed: bool | None = None) -> str | None:
        """The trainer backend this recipe runs on (None: decided on the trainer's machine); ConfigError when
        none can (see :func:`raygym.config.recipe_checks.check_trainer_backend`)."""
        return recipe_checks.check_trainer_backend(self, megatron_installed=megatron_installed)

    def trainer_backend_summary(self, *, megatron_installed: bool) -> str:
        """One line for ``raygym plan``: the trainer backend this recipe runs on and why.

        >>> Recipe(tensor_model_parallel_size=2).trainer_backend_summary(megatron_installed=True)
        'trainer backend: megatron (tensor_model_parallel_size=2 needs it)'
        """
        return recipe_checks.trainer_backend_summary(self, megatron_installed=megatron_installed)

    def validate_model_parallelism(self, model: ModelConfig) -> None:
        """Check the parallel sizes against the model's architecture, where the architecture is known."""
        recipe_checks.validate_model_parallelism(self, model)

    def cli_args(self) -> list[str]:
        """The recipe as kebab-case flags (``--n-samples-per-prompt 8``); see ``TrainConfig.cli_args``."""
        return encode_section("recipe", self)

    def __eq__(self, other: object) -> bool:
        # A function and its import path name the same function: equal (so CLI round trips are exact).
        if not isinstance(other, Recipe):
            return NotImplemented
        mine, theirs = self.field_values(), other.field_values()
        for field in CUSTOM_FUNCTION_FIELDS:
            mine[field] = callable_identity(mine[field])
            theirs[field] = callable_identity(theirs[field])
        return mine == theirs

    __hash__ = None  # type: ignore[assignment]

