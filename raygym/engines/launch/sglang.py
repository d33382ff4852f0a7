"""Command lines for the two inference servers an EngineActor can own (no torch; the only I/O: the SGLang command
line reads a local checkpoint's ``config.json``, :func:`sglang_model_overrides`).

SGLang's flags move between releases (``--cuda-graph-bs`` became an ambiguous prefix in 0.5.23, which has
``--cuda-graph-bs-decode``/``-prefill``; ``--cuda-graph-backend-prefill`` does not exist in 0.5.6), so the
SGLang command line is built for the version that will run it. CI parses what this module builds with
SGLang's own argument parser for every version the ``sglang`` extra allows.

>>> from raygym.config import Recipe
>>> argv = build_sglang_argv(Recipe(rollout_num_gpus_per_engine=2), model_path="/ckpt", host="127.0.0.1",
...                          port=30000, python="python", sglang_version="0.5.18")
>>> argv[:3], argv[argv.index("--tp-size") + 1]
(['python', '-m', 'sglang.launch_server'], '2')
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raygym.cluster.cpu_threads import split_cores
from raygym.config import Recipe
from raygym.engine_api.kinds import DIRECT_LOADER, MODEL_LOADER, check_routing_replay, version_tuple
from raygym.errors import ConfigError
from raygym.routed_experts import SERVER_FLAG

DELTA_LOADER = DIRECT_LOADER  # raygym's server applies raygym payloads by HF name
# The SGLang releases the ``sglang`` extra allows: verl's pin, slime's image, the CPU recipe's, the latest.
SUPPORTED_SGLANG = ("0.5.6", "0.5.15.post1", "0.5.18", "0.5.23")
_CUDA_GRAPH_SPLIT = (0, 5, 15)  # from here: --cuda-graph-bs-decode / --cuda-graph-backend-prefill

# recipe field -> (SGLang flag, kind); kind "bool" = flag present when true, "list" = nargs.
_SGLANG_FLAGS: dict[str, tuple[str, str]] = {
    "sglang_dp_size": ("--dp-size", "value"),
    "sglang_ep_size": ("--ep-size", "value"),
    "sglang_enable_dp_attention": ("--enable-dp-attention", "bool"),
    "sglang_enable_dp_lm_head": ("--enable-dp-lm-head", "bool"),
    "sglang_disable_custom_all_reduce": ("--disable-custom-all-reduce", "bool"),
    "sglang_max_running_requests": ("--max-running-requests", "value"),
    "sglang_tool_call_parser": ("--tool-call-parser", "value"),
    "sglang_reasoning_parser": ("--reasoning-parser", "value"),
}
# SGLang server-arg names raygym sets itself; sglang_config may not override them.
_RESERVED_CONFIG_KEYS = {
    "model_path": "hf_checkpoint",
    "host": "the engine's node IP",
    "port": "a free port chosen by the EngineActor",
    "tp_size": "rollout_num_gpus_per_engine",
    "tp": "rollout_num_gpus_per_engine",
    "base_gpu_id": "the engine's placement bundle",
    "random_seed": "seed",
    "custom_weight_loader": "raygym's delta loader",
    "api_key": "the run's engine API key (raygym mints one per run)",
    "admin_api_key": "the run's engine API key (raygym mints one per run)",
    "mem_fraction_static": "sglang_mem_fraction_static",
    "dp_size": "sglang_dp_size",
    "ep_size": "sglang_ep_size",
    "enable_dp_attention": "sglang_enable_dp_attention",
    "enable_dp_lm_head": "sglang_enable_dp_lm_head",
    "disable_custom_all_reduce": "sglang_disable_custom_all_reduce",
    "cuda_graph_bs": "sglang_cuda_graph_bs",
    "cuda_graph_bs_decode": "sglang_cuda_graph_bs",
    "cuda_graph_backend_prefill": "sglang_cuda_graph_backend_prefill",
    "max_running_requests": "sglang_max_running_requests",
    "tool_call_parser": "sglang_tool_call_parser",
    "reasoning_parser": "sglang_reasoning_parser",
}


def raygym_cpu_threads(recipe: Recipe, cores: int) -> int:
    """CPU cores one raygym server may decode on (its ``--max-threads``), on a node of ``cores`` cores. When
    rollout and training take turns (the ``Sync`` schedule, or colocated), the trainer is idle while the
    engines decode, so the engines share every core; when they overlap (``OneStepOff``/``FullyAsync``, not
    colocated) the engines share ``Recipe.engine_cores`` (one each unless ``cpu_engine_cores`` says more) and the
    trainer takes the rest (``raygym.trainer.decisions.cpu_training_threads``). The server uses them for a model
    large enough to gain from them (``raygym.engines.raygym_server.server.cpu_decode_threads``).

    >>> from raygym.presets import tiny
    >>> raygym_cpu_threads(tiny(), 2), raygym_cpu_threads(tiny().model_copy(update={"async_mode": True}), 16)
    (2, 1)
    >>> raygym_cpu_threads(tiny().replace(async_mode=True, cpu_engine_cores=3), 16)
    3
    >>> raygym_cpu_threads(Recipe(rollout_num_gpus=2, rollout_num_gpus_per_engine=1), 8)  # colocated: turns
    4
    """
    engines = max(1, recipe.gpu_allocation().rollout_engines)
    if recipe.engines_overlap_training:
        return max(1, recipe.engine_cores // engines)
    return max(1, cores // engines)


def engine_cpu_cores(recipe: Recipe, cores: Sequence[int]) -> tuple[int, ...] | None:
    """The cores the CPU engines on a node of ``cores`` are pinned to (raygym's servers through ``--cpu-cores``,
    stock SGLang through :func:`stock_engine_bind_env` and the process's affinity): with
    ``cpu_placement="disjoint"``, when they decode while the trainer trains, the last ``Recipe.engine_cores``, the
    trainer ranks keeping the others (``raygym.trainer.decisions.cpu_training_cores``: the same split). None:
    not pinned.

    >>> from raygym.presets import tiny
    >>> engine_cpu_cores(tiny().replace(async_mode=True), [0, 1]), engine_cpu_cores(tiny(), [0, 1])
    ((1,), None)
    >>> engine_cpu_cores(tiny().replace(async_mode=True, cpu_placement="shared"), [0, 1]) is None
    True
    """
    if recipe.cpu_placement != "disjoint" or not recipe.engines_overlap_training:
        return None
    split = split_cores(cores, recipe.engine_cores, recipe.actor_num_gpus_per_node)
    return None if split is None else split.engines


# The environment every stock SGLang engine runs with. ``SGLANG_VLM_CACHE_SIZE_MB=0``: SGLang keeps the vision
# tower's features of every image it has seen (``sglang/srt/managers/mm_schedule.py``, a cache keyed by the image's
# hash that no weight update or ``/flush_cache`` clears, in 0.5.18), so after a weight sync an image seen before would
# still be embedded by the old vision tower; SGLang turns the cache off itself for RL (``--rl-on-policy-target``).
# Only vision-language models use it.
STOCK_SGLANG_ENV = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}


def stock_engine_bind_env(backend: str, cores: Sequence[int], tp_size: int) -> dict[str, str]:
    """The environment that binds stock SGLang's CPU compute threads to ``cores`` (its tensor-parallel ranks to
    equal slices of them): ``SGLANG_CPU_OMP_THREADS_BIND``, core lists joined by ``|``, one per rank. Without it
    SGLang takes every core of the NUMA node, the trainer's too.

    >>> stock_engine_bind_env("sglang", [1], 1), stock_engine_bind_env("sglang", [4, 5, 6, 7], 2)
    ({'SGLANG_CPU_OMP_THREADS_BIND': '1'}, {'SGLANG_CPU_OMP_THREADS_BIND': '4,5|6,7'})
    >>> stock_engine_bind_env("raygym", [1], 1)
    {}
    """
    if backend != "sglang":
        return {}
    per_rank = max(1, len(cores) // tp_size)
    ranks = [cores[r * per_rank:(r + 1) * per_rank] or cores[-1:] for r in range(tp_size)]
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, rank)) for rank in ranks)}


def raygym_max_running_requests(recipe: Recipe) -> int:
    """Rows the built-in server decodes together: ``sglang_max_running_requests`` when set, else a whole
    step's samples (``rollout_batch_size * n_samples_per_prompt``, at least 64, at most 512): the manager
    sends a step in one batched request per engine, and two half batches cost more than one full one.

    >>> raygym_max_running_requests(Recipe(rollout_batch_size=16, n_samples_per_prompt=8, global_batch_size=8))
    128
    >>> raygym_max_running_requests(Recipe(sglang_max_running_requests=32))
    32
    """
    if recipe.sglang_max_running_requests is not None:
        return recipe.sglang_max_running_requests
    return max(64, min(512, recipe.rollout_batch_size * recipe.n_samples_per_prompt))


def cpu_kv_tokens(recipe: Recipe) -> int:
    """KV-cache tokens for SGLang on CPU, where its default sizes the cache from host memory: a step's
    requests at full length, between 4096 and 131072.

    >>> cpu_kv_tokens(Recipe(rollout_max_response_len=64, eval_interval=None))
    131072
    """
    per_request = (recipe.rollout_max_prompt_len or 1024) + max(recipe.rollout_max_response_len,
                                                                recipe.eval_max_response_len
                                                                if recipe.eval_interval else 0)
    return max(4096, min(131072, raygym_max_running_requests(recipe) * per_request))


def render_sglang_config(recipe: Recipe, api_key: str | None = None) -> str | None:
    """The text of SGLang's ``--config`` file: ``sglang_config`` plus the engine API key, or None when
    there is neither. The key goes here, not on the command line (SGLang reads it from no environment
    variable); the caller writes the file readable by its owner only.

    Written as JSON, which is valid YAML, so no YAML library is needed. Keys raygym sets from
    recipe fields are refused with a ConfigError naming the field to use instead.
    """
    config: Mapping[str, Any] = recipe.sglang_config or {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"sglang_config={config!r}: must be a dict of SGLang server arguments")
    for key in config:
        norm = str(key).lstrip("-").replace("-", "_")
        if norm in _RESERVED_CONFIG_KEYS:
            raise ConfigError(
                f"sglang_config[{key!r}]: raygym sets this SGLang argument itself; "
                f"set {_RESERVED_CONFIG_KEYS[norm]} instead and remove it from sglang_config"
            )
    normalized = {str(k).lstrip("-").replace("_", "-"): v for k, v in config.items()}
    if api_key:
        normalized["api-key"] = api_key
    if not normalized:
        return None
    return json.dumps(normalized, indent=2, sort_keys=True) + "\n"


def _config_sets(recipe: Recipe, name: str) -> bool:
    return any(str(k).lstrip("-").replace("-", "_") == name for k in (recipe.sglang_config or {}))


def sglang_model_overrides(hf_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """What SGLang must read differently from the checkpoint's ``config.json`` (``--json-model-override-args``).

    A Qwen2-VL-family checkpoint whose ``video_token_id`` is its ``image_token_id`` (the builtin tiny VLM: its
    tokenizer has no ``<|video_pad|>``) gets a video token outside its vocabulary: SGLang's M-RoPE position index
    (``sglang/srt/layers/rotary_embedding/mrope_rope_index.py``, ``get_rope_index``) counts every pad that follows
    ``<|vision_start|>`` as a video too, takes the image for a video (``ed_image < ed_video`` is false when both are
    the same pad) and fails on the missing ``video_grid_thw`` (``TypeError: 'NoneType' object is not
    subscriptable``) for every request with an image. No prompt holds the new id, so no video is ever found.

    >>> sglang_model_overrides({"vision_config": {}, "image_token_id": 51, "video_token_id": 51,
    ...                         "text_config": {"vocab_size": 53}})
    {'video_token_id': 53}
    >>> sglang_model_overrides({"vision_config": {}, "image_token_id": 151655, "video_token_id": 151656})
    {}
    """
    if not hf_config or "vision_config" not in hf_config:
        return {}
    image, video = hf_config.get("image_token_id"), hf_config.get("video_token_id")
    if image is None or video != image:
        return {}
    text = hf_config.get("text_config") or {}
    vocab = text.get("vocab_size") or hf_config.get("vocab_size")
    if not vocab:
        raise ConfigError("the checkpoint's config.json gives its video token the image token's id and no vocab_size: "
                          "stock SGLang cannot tell its images from videos; give the checkpoint a video token of its "
                          "own or use --rollout-engine raygym")
    return {"video_token_id": int(vocab)}


def local_checkpoint_config(model_path: str) -> dict[str, Any] | None:
    """``model_path/config.json`` when ``model_path`` is a local directory holding one (else None)."""
    path = os.path.join(os.path.expanduser(model_path), "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def build_sglang_argv(
    recipe: Recipe,
    *,
    model_path: str,
    host: str,
    port: int,
    python: str = "python",
    sglang_version: str | None = None,
    device: str = "cuda",
    config_path: str | None = None,
    base_gpu_id: int = 0,
    nccl_port: int | None = None,
    weight_version: str | int | None = None,
    custom_weight_loaders: Sequence[str] = (MODEL_LOADER,),
    skip_server_warmup: bool = False,
    hf_config: Mapping[str, Any] | None = None,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine from the recipe's sglang_* fields.

    tp = ``rollout_num_gpus_per_engine``; ``sglang_version`` picks the flag spellings (None: the latest);
    ``device="cpu"`` runs SGLang's CPU backend (``SGLANG_USE_CPU_ENGINE=1`` in its environment) with a
    KV cache sized by :func:`cpu_kv_tokens`; colocated on GPU the server gets ``--enable-memory-saver``,
    without which ``/release_memory_occupation`` frees nothing. ``config_path``: where the caller wrote
    :func:`render_sglang_config` (required when it returns text). The log level is ``warning``: SGLang
    logs its whole configuration at ``info``, API key included. ``hf_config``: the checkpoint's ``config.json``
    (None: read from ``model_path`` when that is a local directory), for :func:`sglang_model_overrides`.
    """
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    version = version_tuple(sglang_version or SUPPORTED_SGLANG[-1])
    argv = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port)]
    argv += ["--tp-size", str(recipe.rollout_num_gpus_per_engine), "--base-gpu-id", str(base_gpu_id),
             "--trust-remote-code", "--mem-fraction-static", str(recipe.sglang_mem_fraction_static)]
    for name, (flag, kind) in _SGLANG_FLAGS.items():
        value = getattr(recipe, name)
        if value is None or value is False:
            continue
        argv += [flag] if kind == "bool" else [flag, str(value)]
    argv += _cuda_graph_flags(recipe, version)
    argv += ["--random-seed", str(recipe.seed)]
    if device == "cpu":
        argv += ["--device", "cpu", "--disable-overlap-schedule"]
        if not _config_sets(recipe, "max_total_tokens"):
            argv += ["--max-total-tokens", str(cpu_kv_tokens(recipe))]
    elif recipe.colocate:
        argv.append("--enable-memory-saver")
    if not _config_sets(recipe, "log_level"):
        argv += ["--log-level", "warning"]
    if not _config_sets(recipe, "sleep_on_idle"):
        # SGLang's scheduler polls its sockets in a busy loop between requests: a whole core per engine, taken from
        # the trainer while the engine waits for weights (measured on its CPU backend: 97% of a core idle, 1% with
        # the flag). The flag parks it on those sockets (zmq poll), so a request still wakes it at once.
        argv.append("--sleep-on-idle")
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if custom_weight_loaders:
        argv += ["--custom-weight-loader", *custom_weight_loaders]
    if config_path:
        argv += ["--config", config_path]
    elif recipe.sglang_config:
        raise ConfigError("sglang_config is set: write render_sglang_config() to a file and pass config_path")
    if skip_server_warmup:
        argv.append("--skip-server-warmup")
    overrides = sglang_model_overrides(hf_config if hf_config is not None else local_checkpoint_config(model_path))
    if overrides:
        if _config_sets(recipe, "json_model_override_args"):
            raise ConfigError(f"sglang_config sets json_model_override_args, and this checkpoint needs {overrides} "
                              "overridden for SGLang (raygym.engines.launch.sglang.sglang_model_overrides); put them "
                              "into yours")
        argv += ["--json-model-override-args", json.dumps(overrides)]
    if recipe.use_rollout_routing_replay:  # answers carry meta_info.routed_experts when a request asks
        check_routing_replay("sglang", cuda=device != "cpu", version=sglang_version)
        argv.append(SERVER_FLAG)
    return argv + list(extra_args)


def _cuda_graph_flags(recipe: Recipe, version: tuple[int, ...]) -> list[str]:
    out: list[str] = []
    if recipe.sglang_cuda_graph_bs is not None:
        if not recipe.sglang_cuda_graph_bs:
            raise ConfigError("sglang_cuda_graph_bs=[]: must be a non-empty list of ints, e.g. [1, 2, 4, 8]")
        flag = "--cuda-graph-bs-decode" if version >= _CUDA_GRAPH_SPLIT else "--cuda-graph-bs"
        out += [flag, *(str(int(v)) for v in recipe.sglang_cuda_graph_bs)]
    if recipe.sglang_cuda_graph_backend_prefill is not None:
        if version < _CUDA_GRAPH_SPLIT:
            raise ConfigError(
                f"sglang_cuda_graph_backend_prefill={recipe.sglang_cuda_graph_backend_prefill!r}: SGLang "
                f"{'.'.join(map(str, version))} has no --cuda-graph-backend-prefill (it arrived by 0.5.15); "
                "unset it or use a newer SGLang"
            )
        out += ["--cuda-graph-backend-prefill", recipe.sglang_cuda_graph_backend_prefill]
    return out


def build_raygym_server_argv(
    *,
    model_path: str,
    host: str,
    port: int,
    python: str = "python",
    device: str = "auto",
    dtype: str = "auto",
    max_running_requests: int = 64,
    max_threads: int | None = None,
    cpu_cores: Sequence[int] | None = None,
    custom_weight_loaders: Sequence[str] = (),
    weight_version: str | int | None = None,
    seed: int | None = None,
    return_routed_experts: bool = False,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """``python -m raygym.engines.raygym_server.server ...`` (the built-in server, CPU or GPU). Its API key comes from
    the environment (``raygym.engine_api.auth.ENGINE_API_KEY_ENV``), never from this command line.
    ``return_routed_experts``: MoE routing replay (the server keeps its routers' choices for requests that ask).
    ``max_threads``: the CPU cores it may decode on (None: one; the server uses them for models large enough).
    ``cpu_cores``: the cores it is pinned to (None: not pinned)."""
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    if max_running_requests < 1:
        raise ConfigError(f"sglang_max_running_requests={max_running_requests}: must be >= 1")
    argv = [python, "-m", "raygym.engines.raygym_server.server", "--model-path", model_path, "--host", host, "--port", str(port)]
    argv += ["--device", device, "--dtype", dtype, "--max-running-requests", str(max_running_requests)]
    if max_threads is not None:
        argv += ["--max-threads", str(max_threads)]
    if cpu_cores:
        argv += ["--cpu-cores", ",".join(map(str, cpu_cores))]
    if custom_weight_loaders:
        argv += ["--custom-weight-loader", *custom_weight_loaders]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if return_routed_experts:
        argv.append(SERVER_FLAG)
    return argv + list(extra_args)
