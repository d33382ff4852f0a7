"""Plain data records that travel between the rollout side and the trainers.

No Ray, no torch at import: these are the shapes every actor agrees on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Sample:
    """One sampled response to one prompt, with everything training needs.

    ``loss_mask`` has one entry per response token: 1 for tokens the policy produced and is
    trained on, 0 for tokens that came from elsewhere (tool output, user turns in multi-turn).

    >>> s = Sample(prompt="2+2=", prompt_tokens=[5, 6, 5, 7], group_index=0)
    >>> s.response_tokens, s.status
    ([], 'pending')
    """

    prompt: Any  # str, or a list of chat messages before templating
    prompt_tokens: list[int]
    group_index: int  # which prompt of the step (samples of one group are contiguous)
    sample_index: int = 0  # position inside its group
    data_index: int = -1  # row of the prompt dataset it came from
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response_tokens: list[int] = field(default_factory=list)
    response_text: str = ""
    rollout_log_probs: list[float] = field(default_factory=list)  # log-prob of each sampled token
    loss_mask: list[int] | None = None  # None = every response token is trained
    reward: float | None = None
    reward_error: str | None = None  # the exception text when the reward function raised
    reward_components: dict[str, float | None] = field(default_factory=dict)  # per reward function (None: no reward)
    columns: dict[str, Any] = field(default_factory=dict)  # the prompt row's other data columns, by name
    weight_version: int = 0  # the oldest policy version any of its tokens came from (see token_versions)
    token_versions: list[int] = field(default_factory=list)  # per response token (empty: all weight_version)
    prompt_key: int = -1  # its prompt's place in the run's prompt stream (PromptDataset.position); -1 = none
    finish_reason: str = ""  # "stop" | "length" | "abort"
    status: str = "pending"  # "pending" | "completed" | "truncated" | "aborted" | "failed"
    engine: str = ""  # which engine generated it (for traces and fault reports)
    trace: dict[str, Any] | None = None  # sampled request trace when capture_trace is on
    metrics: dict[str, float] = field(default_factory=dict)  # per-sample numbers, logged as rollout/<name> means
    teacher_log_probs: list[float] | None = None  # distillation: the teacher's log-prob of each response token
    # MoE routing replay: the experts the engine routed each forwarded token to, [tokens - 1, layers * top_k]
    # int16 (raygym/routed_experts.py); None when the engine returned none
    routed_experts: np.ndarray | None = None
    # vision-language prompts: the prompt's images, in placeholder order, as PNG data URLs
    # (raygym/vision/images.py); prompt_tokens hold each one's widened image tokens
    images: list[str] = field(default_factory=list)

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_tokens)

    @property
    def max_version(self) -> int:
        """The newest policy version among its tokens (> ``weight_version`` when a weight update landed while
        it was generated and it continued on the new weights).

        >>> Sample(prompt="", prompt_tokens=[1], group_index=0, weight_version=3, token_versions=[3, 3, 4]).max_version
        4
        """
        return max(self.token_versions, default=self.weight_version)
