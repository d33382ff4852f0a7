"""The rollout manager's view of the recipe (:mod:`raygym.config.views`): the fields it reads, typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raygym.config.base import CustomFunction
from raygym.config.views import build_view, recipe_view

if TYPE_CHECKING:
    from raygym.config.run import TrainConfig


@recipe_view()
@dataclass(frozen=True)
class RolloutSettings:
    """The recipe fields the rollout manager reads (see :mod:`raygym.config.views`)."""

    rollout_batch_size: int
    n_samples_per_prompt: int
    rollout_temperature: float
    rollout_top_p: float
    rollout_stop_token_ids: list[int] | None
    rollout_max_response_len: int
    sglang_request_params: dict[str, Any] | None
    over_sampling_batch_size: int | None  # prompts per dynamic-sampling round (None = only the missing groups)
    dynamic_sampling_filter_path: str | None
    n_samples_per_eval_prompt: int
    eval_max_response_len: int
    eval_top_p: float
    use_fault_tolerance: bool
    rollout_health_check_interval: int
    rollout_health_check_timeout: int
    rollout_health_check_first_wait: int
    capture_trace: bool
    trace_sample_limit: int
    custom_generate_function: CustomFunction
    rollout_function: CustomFunction
    rollout_env: CustomFunction  # raygym/envs: one episode per sample
    rollout_env_max_turns: int
    rollout_env_max_context_len: int | None
    seed: int

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> RolloutSettings:
        """The rollout view of ``cfg.recipe``."""
        return build_view(cls, cfg.recipe)
