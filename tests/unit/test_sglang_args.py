"""Launch command lines for SGLang and raygym's server, built from a real Recipe (pure). SGLang's own
parser checks these command lines per release in tests/sglang_cpu/test_launch_flags.py."""

from __future__ import annotations

import json

import pytest

from raygym.config import Recipe
from raygym.engine_api.kinds import MODEL_LOADER
from raygym.engines.launch.sglang import (
    DELTA_LOADER,
    SUPPORTED_SGLANG,
    build_raygym_server_argv,
    build_sglang_argv,
    cpu_kv_tokens,
    render_sglang_config,
)
from raygym.errors import ConfigError


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next ``--`` option."""
    i = argv.index(flag)
    out = []
    for a in argv[i + 1 :]:
        if a.startswith("--"):
            break
        out.append(a)
    return out


def full_recipe(**overrides) -> Recipe:
    fields = dict(
        rollout_num_gpus_per_engine=4,
        sglang_mem_fraction_static=0.62,
        sglang_dp_size=2,
        sglang_ep_size=4,
        sglang_enable_dp_attention=True,
        sglang_enable_dp_lm_head=True,
        sglang_disable_custom_all_reduce=True,
        sglang_cuda_graph_bs=[1, 2, 4, 8],
        sglang_cuda_graph_backend_prefill="disabled",
        sglang_max_running_requests=128,
        sglang_tool_call_parser="qwen25",
        sglang_reasoning_parser="qwen3",
        seed=1234,
    )
    fields.update(overrides)
    return Recipe(**fields)


def test_every_sglang_field_becomes_its_flag():
    argv = build_sglang_argv(full_recipe(), model_path="/ckpt/qwen3", host="10.0.0.3", port=30001, python="py",
                             sglang_version="0.5.18", nccl_port=40000, weight_version=3)
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    expect = {
        "--model-path": ["/ckpt/qwen3"], "--host": ["10.0.0.3"], "--port": ["30001"], "--tp-size": ["4"],
        "--base-gpu-id": ["0"], "--mem-fraction-static": ["0.62"], "--dp-size": ["2"], "--ep-size": ["4"],
        "--cuda-graph-bs-decode": ["1", "2", "4", "8"], "--cuda-graph-backend-prefill": ["disabled"],
        "--max-running-requests": ["128"], "--tool-call-parser": ["qwen25"], "--reasoning-parser": ["qwen3"],
        "--random-seed": ["1234"], "--nccl-port": ["40000"], "--weight-version": ["3"],
        "--custom-weight-loader": [MODEL_LOADER], "--log-level": ["warning"],
    }
    for flag, values in expect.items():
        assert flag_values(argv, flag) == values, flag
    for flag in ("--enable-dp-attention", "--enable-dp-lm-head", "--disable-custom-all-reduce",
                 "--trust-remote-code", "--enable-memory-saver",  # the recipe is colocated: memory saver on GPU
                 "--sleep-on-idle"):  # an idle scheduler leaves the trainer its cores
        assert flag in argv and flag_values(argv, flag) == []
    assert argv.count("--mem-fraction-static") == 1
    assert "--config" not in argv and "--skip-server-warmup" not in argv and "--device" not in argv


@pytest.mark.parametrize("version, flag", [("0.5.6", "--cuda-graph-bs"), ("0.5.15.post1", "--cuda-graph-bs-decode"),
                                           ("0.5.23", "--cuda-graph-bs-decode")])
def test_cuda_graph_batch_sizes_use_the_release_spelling(version, flag):
    recipe = full_recipe(sglang_cuda_graph_backend_prefill=None)
    argv = build_sglang_argv(recipe, model_path="m", host="127.0.0.1", port=1, sglang_version=version)
    assert flag_values(argv, flag) == ["1", "2", "4", "8"]
    assert not {"--cuda-graph-bs", "--cuda-graph-bs-decode"} - {flag} & set(argv)


def test_an_argument_the_release_lacks_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="sglang_cuda_graph_backend_prefill.*0.5.6"):
        build_sglang_argv(full_recipe(), model_path="m", host="127.0.0.1", port=1, sglang_version="0.5.6")


def test_cpu_engines_get_the_cpu_backend_and_a_bounded_kv_cache():
    recipe = Recipe(colocate=True)
    argv = build_sglang_argv(recipe, model_path="m", host="127.0.0.1", port=1, device="cpu")
    assert flag_values(argv, "--device") == ["cpu"] and "--disable-overlap-schedule" in argv
    assert flag_values(argv, "--max-total-tokens") == [str(cpu_kv_tokens(recipe))]
    assert "--enable-memory-saver" not in argv  # torch_memory_saver is CUDA-only
    disagg = build_sglang_argv(Recipe(colocate=False), model_path="m", host="127.0.0.1", port=1)
    assert "--enable-memory-saver" not in disagg


def test_unset_and_false_fields_add_nothing_and_defaults_apply():
    argv = build_sglang_argv(Recipe(), model_path="m", host="127.0.0.1", port=1)
    assert flag_values(argv, "--tp-size") == ["1"]
    assert flag_values(argv, "--mem-fraction-static") == ["0.75"]  # Qwen3_4B_Recipe default
    for flag in ("--dp-size", "--ep-size", "--enable-dp-attention", "--cuda-graph-bs", "--cuda-graph-bs-decode",
                 "--max-running-requests", "--tool-call-parser", "--reasoning-parser"):
        assert flag not in argv


def test_the_api_key_goes_to_the_config_file_never_the_command_line():
    recipe = full_recipe(sglang_config={"chunked_prefill_size": 4096, "enable-metrics": True})
    text = render_sglang_config(recipe, api_key="s3cr3t")
    assert json.loads(text) == {"chunked-prefill-size": 4096, "enable-metrics": True, "api-key": "s3cr3t"}
    argv = build_sglang_argv(recipe, model_path="m", host="127.0.0.1", port=1, config_path="/tmp/x/cfg.yaml")
    assert flag_values(argv, "--config") == ["/tmp/x/cfg.yaml"] and "s3cr3t" not in " ".join(argv)
    with pytest.raises(ConfigError, match="config_path"):
        build_sglang_argv(recipe, model_path="m", host="127.0.0.1", port=1)
    assert render_sglang_config(full_recipe()) is None
    assert json.loads(render_sglang_config(full_recipe(), api_key="k")) == {"api-key": "k"}


@pytest.mark.parametrize(
    "key, field",
    [("tp_size", "rollout_num_gpus_per_engine"), ("--port", "free port"),
     ("mem-fraction-static", "sglang_mem_fraction_static"), ("api_key", "API key")],
)
def test_sglang_config_may_not_override_what_raygym_sets(key, field):
    with pytest.raises(ConfigError, match=field):
        render_sglang_config(full_recipe(sglang_config={key: 1}))


def test_bad_values_raise_config_errors_naming_the_field():
    with pytest.raises(ConfigError, match="rollout_num_gpus_per_engine"):
        Recipe(rollout_num_gpus_per_engine=0)
    with pytest.raises(ConfigError, match="sglang_cuda_graph_bs"):
        build_sglang_argv(Recipe(sglang_cuda_graph_bs=[]), model_path="m", host="127.0.0.1", port=1)
    with pytest.raises(ConfigError, match="0.0.0.0"):
        build_sglang_argv(Recipe(), model_path="m", host="0.0.0.0", port=1)
    with pytest.raises(ConfigError, match="max_running_requests"):
        build_raygym_server_argv(model_path="m", host="127.0.0.1", port=1, max_running_requests=0)


def test_supported_releases_are_the_ones_the_extra_allows():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (spec,) = pyproject["project"]["optional-dependencies"]["sglang"]
    assert spec == f"sglang>={SUPPORTED_SGLANG[0]},<={SUPPORTED_SGLANG[-1]}"


def test_raygym_server_argv_parses_with_the_server_parser():
    from raygym.engines.raygym_server.server import parse_args

    argv = build_raygym_server_argv(
        model_path="builtin:tiny-qwen3", host="127.0.0.1", port=31000, python="py", device="cpu",
        max_running_requests=32, max_threads=2, custom_weight_loaders=[DELTA_LOADER], weight_version=5, seed=7,
        extra_args=["--weight-update-timeout", "60", "--weight-source", "/shared/sync"],
    )
    assert argv[:3] == ["py", "-m", "raygym.engines.raygym_server.server"]
    args = parse_args(argv[3:])
    assert (args.max_threads, args.num_threads) == (2, None)
    assert (args.model_path, args.host, args.port, args.device, args.max_running_requests) == (
        "builtin:tiny-qwen3", "127.0.0.1", 31000, "cpu", 32)
    assert (args.custom_weight_loader, args.weight_version, args.seed, args.weight_update_timeout,
            args.weight_source) == ([DELTA_LOADER], "5", 7, 60.0, ["/shared/sync"])


def test_an_idle_scheduler_sleeps_unless_the_sglang_config_says_otherwise():
    for device in ("cpu", "cuda"):
        argv = build_sglang_argv(Recipe(), model_path="m", host="127.0.0.1", port=1, device=device)
        assert argv.count("--sleep-on-idle") == 1
    own = build_sglang_argv(Recipe(sglang_config={"sleep_on_idle": False}), model_path="m", host="127.0.0.1", port=1,
                            config_path="/tmp/sglang.yaml")
    assert "--sleep-on-idle" not in own
