"""The config sections besides the recipe: ``ModelConfig`` (the policy model), ``DatasetConfig`` (the prompt
data), ``MetricsConfig`` (metric sinks) and ``RunLocation`` (where a run writes, under which id). Pure.

>>> DatasetConfig().prompt_data, RunLocation(output_dir="/tmp/run1").output_dir
('builtin:next-digit', '/tmp/run1')
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from raygym.config.base import (
    Section,
    check_choice,
    check_int,
    check_unsupported,
    option,
    option_factory,
)
from raygym.config.constants import UNSUPPORTED_MODEL_FIELDS
from raygym.errors import ConfigError


class ModelConfig(Section):
    """The policy model: where the weights are and, optionally, its architecture.

    >>> ModelConfig(hf_checkpoint="builtin:tiny-qwen3").dtype
    'auto'
    """

    hf_checkpoint: str = option(
        ..., "HF checkpoint: a local path, an fsspec URL, an HF id or 'builtin:tiny-qwen3'."
    )
    ref_checkpoint: str | None = option(
        None, "Reference model for KL terms when recipe.ref_load is empty; None = the initial policy weights."
    )
    dtype: str = option(
        "auto",
        "Trainer compute dtype: 'auto' (bfloat16 on GPU, float32 on CPU), 'bfloat16', 'float16' (Megatron "
        "backend only) or 'float32'. The torch backend keeps float32 master weights; engines choose their own serving dtype "
        "(raygym's server and vLLM: the checkpoint's; stock SGLang's 'auto' serves a float32 checkpoint in float16).",
    )
    tokenizer: str | None = option(
        None, "Tokenizer path; not supported, leave unset: every part of a run uses the checkpoint's own."
    )
    trust_remote_code: bool = option(
        False, "Run model code shipped with the checkpoint; not supported (raygym never runs it)."
    )
    num_experts: int | None = option(
        None, "MoE experts per layer (None for dense models or unknown); checked against the checkpoint."
    )
    moe_router_topk: int | None = option(
        None, "Experts each token is routed to (MoE); checked against the checkpoint."
    )
    num_layers: int | None = option(
        None, "Transformer layers (optional; checked against pipeline parallelism and the checkpoint)."
    )
    hidden_size: int | None = option(None, "Hidden size (optional; checked against the checkpoint).")

    @model_validator(mode="after")
    def _validate(self) -> ModelConfig:
        if not self.hf_checkpoint.strip():
            raise ConfigError(
                "hf_checkpoint='': required; set --hf-checkpoint to a path, URL or 'builtin:tiny-qwen3'"
            )
        check_choice("dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        for field in ("num_experts", "moe_router_topk", "num_layers", "hidden_size"):
            check_int(field, getattr(self, field), 1, optional=True)
        check_unsupported(self.field_values(), UNSUPPORTED_MODEL_FIELDS)
        return self


class DatasetConfig(Section):
    """The prompt data: a jsonl/parquet file (path or fsspec URL), ``builtin:next-digit`` or ``builtin:long-tail``.

    >>> DatasetConfig(prompt_data="gsm8k.jsonl", input_key="question", label_key="answer").format
    'auto'
    """

    prompt_data: str = option(
        "builtin:next-digit",
        "Training prompts: a jsonl/parquet path or fsspec URL, or builtin:next-digit / builtin:long-tail.",
    )
    input_key: str = option("prompt", "Column holding the prompt (a string or a list of chat messages).")
    label_key: str | None = option("label", "Column holding the label passed to the reward function.")
    metadata_key: str | None = option(
        "metadata", "Column holding per-row metadata passed to the reward function."
    )
    apply_chat_template: bool = option(False, "Format prompts with the tokenizer's chat template.")
    apply_chat_template_kwargs: dict[str, Any] = option_factory(dict, "Keyword arguments for apply_chat_template.")
    eval_prompt_data: dict[str, str] = option_factory(dict, "Eval datasets: name -> path or fsspec URL.")
    format: str = option("auto", "File format: 'auto' (from the extension), 'jsonl' or 'parquet'.")

    @model_validator(mode="after")
    def _validate(self) -> DatasetConfig:
        if not self.prompt_data.strip():
            raise ConfigError("prompt_data='': required; set --prompt-data to a jsonl/parquet path or URL")
        if not self.input_key:
            raise ConfigError("input_key='': required; set --input-key to the prompt column (e.g. 'prompt')")
        if self.label_key and self.label_key == self.input_key:
            raise ConfigError(
                f"label_key={self.label_key!r} equals input_key; they must name different columns (--label-key)"
            )
        check_choice("format", self.format, ("auto", "jsonl", "parquet"))
        return self


class MetricsConfig(Section):
    """Where metrics go besides ``metrics.jsonl`` (always written). The W&B key is read from
    ``WANDB_API_KEY`` in the environment, never from a config."""

    wandb_project: str | None = option(None, "W&B project; None disables W&B.")
    wandb_group: str | None = option(None, "W&B group.")
    wandb_name: str | None = option(None, "W&B run name; None = the run id.")
    wandb_mode: str = option("online", "W&B mode: 'online', 'offline' or 'disabled'.")
    tensorboard_dir: str | None = option(None, "TensorBoard log directory; None disables TensorBoard.")

    @model_validator(mode="after")
    def _validate(self) -> MetricsConfig:
        check_choice("wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        return self


def new_run_id() -> str:
    """A fresh run id: UTC timestamp plus 6 random hex digits, e.g. ``20250101-120000-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RunLocation(BaseModel):
    """Where a run writes and the id it runs under: the run-level fields of ``TrainConfig``, which extends it
    (flags and TOML files read the run section's fields here)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    output_dir: str | None = option(None, "Run directory (path or fsspec URL); None = runs/<run_id>.")
    run_id: str = option_factory(new_run_id, "Stable id of the run; generated once when unset.")

    @model_validator(mode="after")
    def _check_run_id(self) -> RunLocation:
        if not RUN_ID.match(self.run_id):
            raise ConfigError(
                f"run_id={self.run_id!r}: use letters, digits, '.', '_' and '-' only (--run-id)"
            )
        return self
