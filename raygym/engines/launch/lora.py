"""The server flags that make an engine serve a LoRA run's adapters (pure): passed as the policy engines'
``extra_server_args`` (the judge's engines serve their own model, without them).

- raygym's server: ``--lora-config SPEC`` (adapters attached with B = 0, written by weight sync) or
  ``--lora-adapter DIR`` (a trained adapter loaded at start: ``raygym serve`` / ``raygym eval``);
- stock SGLang: ``--enable-lora --max-lora-rank R --lora-target-modules ... --max-loras-per-batch 1``, plus
  ``--lora-paths NAME=DIR`` for a trained adapter;
- raygym's vLLM adapter: ``--lora-rank R`` (``--lora-adapter DIR`` for a trained one).

>>> from raygym.lora import LoraSpec
>>> spec = LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=("all-linear",))
>>> engine_lora_args("vllm", spec, ["model.layers.0.self_attn.q_proj"])
['--lora-rank', '8']
>>> engine_lora_args("sglang", spec, ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"])[:4]
['--enable-lora', '--max-lora-rank', '8', '--lora-target-modules']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raygym.engine_api.kinds import capabilities, choose_rollout_engine
from raygym.errors import ConfigError
from raygym.lora import ADAPTER_NAME, LoraSpec

if TYPE_CHECKING:
    from raygym.config.recipe import Recipe


def engine_lora_args(kind: str, spec: LoraSpec, targets: list[str], adapter_dir: str | None = None) -> list[str]:
    """Flags for engine kind ``kind`` to serve adapters of ``spec`` on the modules ``targets`` (paths), starting
    from ``adapter_dir`` when given."""
    if kind == "raygym":
        return ["--lora-adapter", adapter_dir] if adapter_dir else ["--lora-config", spec.to_json()]
    if kind == "vllm":
        return ["--lora-rank", str(spec.rank)] + (["--lora-adapter", adapter_dir] if adapter_dir else [])
    if kind == "sglang":
        names = sorted({t.rsplit(".", 1)[-1] for t in targets})
        args = ["--enable-lora", "--max-lora-rank", str(spec.rank), "--lora-target-modules", *names,
                "--max-loras-per-batch", "1"]
        return args + (["--lora-paths", f"{ADAPTER_NAME}={adapter_dir}"] if adapter_dir else [])
    raise ConfigError(f"rollout_engine={kind!r}: no LoRA flags for this engine kind")


def adapter_request_fields(recipe: Recipe) -> dict[str, Any]:
    """What every rollout ``/generate`` request of a run carries besides its prompt: for a LoRA run on engines
    that load adapters by endpoint, the adapter's name as ``lora_path``; {} otherwise."""
    if recipe.lora_rank <= 0:
        return {}
    if capabilities(choose_rollout_engine(recipe.rollout_engine)).lora != "lora_endpoints":
        return {}
    return {"lora_path": ADAPTER_NAME}
