"""Command lines for the two inference servers an EngineActor can own (pure: no I/O, no torch).

``settings`` is anything with the recipe's attribute names (a ``Recipe``, a ``TrainConfig``'s
recipe, a ``SimpleNamespace`` or a plain dict); missing attributes take the spec's defaults.

>>> argv = build_sglang_argv({"rollout_num_gpus_per_engine": 2, "sglang_mem_fraction_static": 0.7},
...                          model_path="/ckpt", host="127.0.0.1", port=30000, python="python")
>>> argv[:3], argv[argv.index("--tp-size") + 1]
(['python', '-m', 'sglang.launch_server'], '2')
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raygym.errors import ConfigError
from raygym.weightsync.payload import LOADER as DELTA_LOADER  # one name for every sender

# recipe field -> (SGLang flag, kind); kind "bool" = flag present when true, "list" = nargs.
_SGLANG_FLAGS: dict[str, tuple[str, str]] = {
    "sglang_mem_fraction_static": ("--mem-fraction-static", "value"),
    "sglang_dp_size": ("--dp-size", "value"),
    "sglang_ep_size": ("--ep-size", "value"),
    "sglang_enable_dp_attention": ("--enable-dp-attention", "bool"),
    "sglang_enable_dp_lm_head": ("--enable-dp-lm-head", "bool"),
    "sglang_disable_custom_all_reduce": ("--disable-custom-all-reduce", "bool"),
    "sglang_cuda_graph_bs": ("--cuda-graph-bs", "list"),
    "sglang_cuda_graph_backend_prefill": ("--cuda-graph-backend-prefill", "value"),
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
    "mem_fraction_static": "sglang_mem_fraction_static",
    "dp_size": "sglang_dp_size",
    "ep_size": "sglang_ep_size",
    "enable_dp_attention": "sglang_enable_dp_attention",
    "enable_dp_lm_head": "sglang_enable_dp_lm_head",
    "disable_custom_all_reduce": "sglang_disable_custom_all_reduce",
    "cuda_graph_bs": "sglang_cuda_graph_bs",
    "cuda_graph_backend_prefill": "sglang_cuda_graph_backend_prefill",
    "max_running_requests": "sglang_max_running_requests",
    "tool_call_parser": "sglang_tool_call_parser",
    "reasoning_parser": "sglang_reasoning_parser",
}


def setting(settings: Any, name: str, default: Any = None) -> Any:
    """Read one recipe field from an object or a mapping."""
    if isinstance(settings, Mapping):
        value = settings.get(name, default)
    else:
        value = getattr(settings, name, default)
    return default if value is None else value


def render_sglang_config(settings: Any) -> str | None:
    """The ``sglang_config`` dict as the text of SGLang's ``--config`` file, or None when unset.

    Written as JSON, which is valid YAML, so no YAML library is needed. Keys raygym sets from
    recipe fields are refused with a ConfigError naming the field to use instead.
    """
    config = setting(settings, "sglang_config")
    if not config:
        return None
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
    return json.dumps(normalized, indent=2, sort_keys=True) + "\n"


def build_sglang_argv(
    settings: Any,
    *,
    model_path: str,
    host: str,
    port: int,
    python: str = "python",
    config_path: str | None = None,
    base_gpu_id: int = 0,
    nccl_port: int | None = None,
    weight_version: str | int | None = None,
    custom_weight_loaders: Sequence[str] = (DELTA_LOADER,),
    skip_server_warmup: bool = False,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one engine from the recipe's sglang_* fields.

    tp = ``rollout_num_gpus_per_engine``; ``config_path`` is where the caller wrote
    :func:`render_sglang_config` (required when ``sglang_config`` is set).
    """
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    tp = int(setting(settings, "rollout_num_gpus_per_engine", 1))
    if tp < 1:
        raise ConfigError(f"rollout_num_gpus_per_engine={tp}: must be >= 1")
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    argv += ["--tp-size", str(tp), "--base-gpu-id", str(base_gpu_id), "--trust-remote-code"]
    argv += ["--mem-fraction-static", str(setting(settings, "sglang_mem_fraction_static", 0.75))]
    for name, (flag, kind) in _SGLANG_FLAGS.items():
        value = setting(settings, name)
        if name == "sglang_mem_fraction_static" or value is None:
            continue
        if kind == "bool":
            if value:
                argv.append(flag)
        elif kind == "list":
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(f"{name}={value!r}: must be a non-empty list of ints, e.g. [1, 2, 4, 8]")
            argv += [flag, *(str(int(v)) for v in value)]
        else:
            argv += [flag, str(value)]
    seed = setting(settings, "seed")
    if seed is not None:
        argv += ["--random-seed", str(seed)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if custom_weight_loaders:
        argv += ["--custom-weight-loader", *custom_weight_loaders]
    if setting(settings, "sglang_config"):
        if not config_path:
            raise ConfigError(
                "sglang_config is set: write render_sglang_config() to a file and pass config_path"
            )
        argv += ["--config", config_path]
    if skip_server_warmup:
        argv.append("--skip-server-warmup")
    return argv + list(extra_args)


def build_raygym_server_argv(
    *,
    model_path: str,
    host: str,
    port: int,
    python: str = "python",
    device: str = "auto",
    dtype: str = "auto",
    max_running_requests: int = 64,
    custom_weight_loaders: Sequence[str] = (),
    weight_version: str | int | None = None,
    seed: int | None = None,
    extra_args: Iterable[str] = (),
) -> list[str]:
    """``python -m raygym.rollout.server ...`` (the built-in server, CPU or GPU)."""
    if host == "0.0.0.0":
        raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
    if max_running_requests < 1:
        raise ConfigError(f"sglang_max_running_requests={max_running_requests}: must be >= 1")
    argv = [
        python,
        "-m",
        "raygym.rollout.server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    argv += ["--device", device, "--dtype", dtype, "--max-running-requests", str(max_running_requests)]
    if custom_weight_loaders:
        argv += ["--custom-weight-loader", *custom_weight_loaders]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv + list(extra_args)
