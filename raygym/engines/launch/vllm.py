"""The command line of raygym's vLLM adapter (:mod:`raygym.engines.vllm.server`) from a recipe (pure).

The recipe's engine fields apply to vLLM as they do to SGLang: ``rollout_num_gpus_per_engine`` is the
tensor-parallel size, ``sglang_mem_fraction_static`` the fraction of GPU memory the engine takes (vLLM's
``gpu_memory_utilization``), ``sglang_max_running_requests`` the sequences it runs at once (vLLM's
``max_num_seqs``; default: a step's samples, as for raygym's server), ``seed`` the engine seed. The context
length covers the longest prompt and response the run asks for (the adapter clamps it to the model's).

>>> from raygym.config import Recipe
>>> argv = build_vllm_argv(Recipe(rollout_num_gpus_per_engine=2), model_path="/ckpt", host="127.0.0.1",
...                        port=30000, python="python")
>>> argv[:3], argv[argv.index("--tensor-parallel-size") + 1], argv[argv.index("--max-model-len") + 1]
(['python', '-m', 'raygym.engines.vllm.server'], '2', '5120')
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from raygym.config import Recipe
from raygym.engines.launch.sglang import raygym_max_running_requests
from raygym.errors import ConfigError

# vLLM's CPU attention kernels take these head sizes only (vllm/v1/attention/backends/cpu_attn.py, 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def max_model_len(recipe: Recipe) -> int:
    """Prompt plus response tokens of the longest request the run sends (eval included when it runs).

    >>> max_model_len(Recipe(rollout_max_prompt_len=100, rollout_max_response_len=50, eval_interval=None))
    150
    """
    response = max(recipe.rollout_max_response_len, recipe.eval_max_response_len if recipe.eval_interval else 0)
    return (recipe.rollout_max_prompt_len or 1024) + response


def build_vllm_argv(recipe: Recipe, *, model_path: str, host: str, port: int, python: str = "python",
                    device: str = "cuda", weight_version: str | int | None = None,
                    extra_args: Iterable[str] = ()) -> list[str]:
    """``python -m raygym.engines.vllm.server ...`` for one engine. Its API key comes from the environment
    (``raygym.engine_api.auth.ENGINE_API_KEY_ENV``), never from this command line. Colocated on GPU the engine
    gets vLLM's sleep mode, without which releasing memory frees nothing."""
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    argv = [python, "-m", "raygym.engines.vllm.server", "--model-path", model_path, "--host", host, "--port", str(port)]
    argv += ["--tensor-parallel-size", str(recipe.rollout_num_gpus_per_engine),
             "--gpu-memory-utilization", str(recipe.sglang_mem_fraction_static),
             "--max-model-len", str(max_model_len(recipe)),
             "--max-num-seqs", str(raygym_max_running_requests(recipe)),
             "--seed", str(recipe.seed), "--weight-update-timeout", str(recipe.update_weight_timeout)]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if device == "cuda" and recipe.colocate:
        argv.append("--enable-sleep-mode")
    return argv + list(extra_args)


def check_cpu_head_dim(head_dim: int | None, model_path: str, what: str = "rollout_engine='vllm'") -> None:
    """ConfigError when vLLM's CPU attention cannot run a model of this head size (``what``: the setting that
    asks vLLM to run it).

    >>> check_cpu_head_dim(16, "builtin:tiny-qwen3")
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: rollout_engine='vllm' on CPU: the model at builtin:tiny-qwen3 has head_dim=16, and vLLM's CPU attention runs head sizes (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512) only; use such a model (for the builtin one: raygym.builtin.materialize_model('builtin:tiny-qwen3', DIR, head_dim=32), then --hf-checkpoint DIR/...) or another engine
    """
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"{what} on CPU: the model at {model_path} has head_dim={head_dim}, and vLLM's CPU "
            f"attention runs head sizes {CPU_HEAD_SIZES} only; use such a model (for the builtin one: "
            "raygym.builtin.materialize_model('builtin:tiny-qwen3', DIR, head_dim=32), then --hf-checkpoint "
            "DIR/...) or another engine")


def checkpoint_head_dim(model_path: str) -> int | None:
    """The attention head size of the HF checkpoint at ``model_path`` (``head_dim``, else hidden size over heads);
    None when there is no local ``config.json`` (a Hub id: vLLM reads it itself).

    >>> checkpoint_head_dim("/nowhere") is None
    True
    """
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    derived = text.get("hidden_size", 0) // heads if isinstance(heads, int) and heads else None
    return text.get("head_dim") or derived


def model_facts(model_path: str) -> dict[str, Any]:
    """What the adapter reads from a HF checkpoint's ``config.json``: vocab size, context length and the
    bytes one token's KV cache takes (per TP rank of 1)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads", 1)
    head_dim = text.get("head_dim") or text.get("hidden_size", 0) // max(1, heads)
    kv_heads = text.get("num_key_value_heads") or heads
    # a vision-language config names the dtype at its top level, not in text_config
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
                or "bfloat16")
    itemsize = 4 if "32" in dtype else 2
    return {"vocab_size": int(text["vocab_size"]), "max_position_embeddings": text.get("max_position_embeddings"),
            "dtype": dtype,
            "head_dim": head_dim, "kv_bytes_per_token": 2 * text.get("num_hidden_layers", 1) * kv_heads * head_dim
            * itemsize}


def cpu_dtype(requested: str, checkpoint_dtype: str, cpu_flags: str) -> str:
    """The dtype vLLM runs on CPU. ``auto`` keeps a float32 checkpoint in float32 on CPUs without bf16 matrix
    instructions (vLLM's own ``auto`` picks bf16 there, which such CPUs emulate: 64 prompts x 64 tokens of a
    10M model ran 4x slower than in float32 on a 2-core AVX2 machine); otherwise vLLM decides.

    >>> cpu_dtype("auto", "float32", "avx2 fma"), cpu_dtype("auto", "float32", "avx512_bf16 amx_bf16")
    ('float32', 'auto')
    """
    if requested == "auto" and checkpoint_dtype == "float32" and not {"avx512_bf16", "amx_bf16"} & set(cpu_flags.split()):
        return "float32"
    return requested


def cpu_engine_args(user_args: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments raygym sets on CPU, under the user's ``--engine-args`` (which win).

    Chunked prefill is off: a request whose prefill vLLM splits has the token it sampled discarded, and vLLM
    rewinds that request's seeded generator with ``Generator.set_offset``, which CPU generators lack ("CPU
    Generator does not use offset"), so the worker dies (vLLM 0.32, ``GPUModelRunner._bookkeeping_sync``).
    raygym seeds every request, and fully async training resumes many long requests at once after a sync, so
    splits are common there. Unsplit, each step's token budget grows to at least the context length (vLLM's
    own rule when chunking is off), the same choice vLLM makes on CPU for MLA models.

    >>> cpu_engine_args({}), cpu_engine_args({"enable_chunked_prefill": True})
    ({'enable_chunked_prefill': False}, {'enable_chunked_prefill': True})
    """
    return {"enable_chunked_prefill": False, **user_args}


def cpu_kv_cache_gib(kv_bytes_per_token: int, max_num_seqs: int, max_model_len: int) -> int:
    """GiB for ``VLLM_CPU_KVCACHE_SPACE``: every sequence at full length, between 1 and 64 GiB.

    >>> cpu_kv_cache_gib(1024, 128, 256)
    1
    """
    return max(1, min(64, math.ceil(kv_bytes_per_token * max_num_seqs * max_model_len / 2**30)))
