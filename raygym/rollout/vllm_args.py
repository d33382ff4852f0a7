"""The command line of raygym's vLLM adapter (:mod:`raygym.rollout.vllm_server`) from a recipe (pure).

The recipe's engine fields apply to vLLM as they do to SGLang: ``rollout_num_gpus_per_engine`` is the
tensor-parallel size, ``sglang_mem_fraction_static`` the fraction of GPU memory the engine takes (vLLM's
``gpu_memory_utilization``), ``sglang_max_running_requests`` the sequences it runs at once (vLLM's
``max_num_seqs``; default: a step's samples, as for raygym's server), ``seed`` the engine seed. The context
length covers the longest prompt and response the run asks for (the adapter clamps it to the model's).

>>> from raygym.config import Recipe
>>> argv = build_vllm_argv(Recipe(rollout_num_gpus_per_engine=2), model_path="/ckpt", host="127.0.0.1",
...                        port=30000, python="python")
>>> argv[:3], argv[argv.index("--tensor-parallel-size") + 1], argv[argv.index("--max-model-len") + 1]
(['python', '-m', 'raygym.rollout.vllm_server'], '2', '5120')
"""

from __future__ import annotations

from collections.abc import Iterable

from raygym.config import Recipe
from raygym.errors import ConfigError
from raygym.rollout.sglang_args import raygym_max_running_requests

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
    """``python -m raygym.rollout.vllm_server ...`` for one engine. Its API key comes from the environment
    (``raygym.rollout.auth.ENGINE_API_KEY_ENV``), never from this command line. Colocated on GPU the engine
    gets vLLM's sleep mode, without which releasing memory frees nothing."""
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    argv = [python, "-m", "raygym.rollout.vllm_server", "--model-path", model_path, "--host", host, "--port", str(port)]
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


def check_cpu_head_dim(head_dim: int | None, model_path: str) -> None:
    """ConfigError when vLLM's CPU attention cannot run a model of this head size.

    >>> check_cpu_head_dim(16, "builtin:tiny-qwen3")
    Traceback (most recent call last):
    ...
    raygym.errors.ConfigError: rollout_engine='vllm' on CPU: the model at builtin:tiny-qwen3 has head_dim=16, and vLLM's CPU attention runs head sizes (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512) only; use such a model (for the builtin one: raygym.builtin.materialize_model('builtin:tiny-qwen3', DIR, head_dim=32), then --hf-checkpoint DIR/...) or another engine
    """
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"rollout_engine='vllm' on CPU: the model at {model_path} has head_dim={head_dim}, and vLLM's CPU "
            f"attention runs head sizes {CPU_HEAD_SIZES} only; use such a model (for the builtin one: "
            "raygym.builtin.materialize_model('builtin:tiny-qwen3', DIR, head_dim=32), then --hf-checkpoint "
            "DIR/...) or another engine")
