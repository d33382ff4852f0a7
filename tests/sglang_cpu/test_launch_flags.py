"""raygym's SGLang command lines, parsed by SGLang's own argument parser, for every release the ``sglang``
extra allows (0.5.6: verl's pin, 0.5.15.post1: slime's image, 0.5.18, 0.5.23: the latest). Each release's
package comes from scripts/install_sglang_cpu.sh (``args/<version>``) and is imported by the SGLang
interpreter; nothing of raygym runs on that side."""

from __future__ import annotations

import json
import subprocess

import pytest

from raygym.config import Recipe
from raygym.engines.launch.sglang import SUPPORTED_SGLANG, build_sglang_argv, render_sglang_config
from raygym.errors import ConfigError

pytestmark = pytest.mark.sglang_cpu

# Runs under SGLang's interpreter: SGLang's parser, its --config merging, the parsed values as JSON lines.
PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
try:
    from sglang.srt.server_args_config_parser import ConfigArgumentMerger
except ImportError:
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
for argv in json.loads(sys.argv[1]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    if "--config" in argv:
        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    ns = parser.parse_args(argv)
    print(json.dumps({k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}))
"""


def parse_with_sglang(python: str, home, version: str, argvs: list[list[str]]) -> list[dict]:
    """Every command line parsed by release ``version``'s own parser (one interpreter start: importing
    SGLang takes a while)."""
    root = home / "args" / version
    if not (root / "sglang").is_dir():
        pytest.fail(f"{root} has no sglang package: scripts/install_sglang_cpu.sh downloads every release")
    done = subprocess.run([python, "-c", PARSE, json.dumps(argvs)], capture_output=True, text=True, timeout=1200,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, f"SGLang {version} refused raygym's command lines {argvs}:\n{done.stderr[-3000:]}"
    return [json.loads(line) for line in done.stdout.strip().splitlines()[-len(argvs):]]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_sglangs_parser_accepts_what_raygym_launches(version, sglang_python, tmp_path):
    from tests.sglang_cpu.conftest import sglang_home

    gpu = Recipe(rollout_num_gpus_per_engine=2, sglang_dp_size=2, sglang_enable_dp_attention=True,
                 sglang_cuda_graph_bs=[1, 2, 4, 8], sglang_max_running_requests=64, sglang_tool_call_parser="qwen25",
                 sglang_reasoning_parser="qwen3", sglang_config={"chunked_prefill_size": 2048}, seed=7,
                 actor_num_gpus_per_node=8)
    config = tmp_path / "sglang_config.yaml"
    config.write_text(render_sglang_config(gpu, api_key="k"))
    argv = build_sglang_argv(gpu, model_path="/ckpt", host="10.0.0.2", port=30000, sglang_version=version,
                             config_path=str(config), nccl_port=40000, weight_version=3)
    cpu = build_sglang_argv(Recipe(), model_path="/ckpt", host="127.0.0.1", port=1, sglang_version=version,
                            device="cpu")
    ns, ns_cpu = parse_with_sglang(sglang_python, sglang_home(), version, [argv[3:], cpu[3:]])
    tp = ns.get("tensor_parallel_size", ns.get("tp_size"))
    dp = ns.get("data_parallel_size", ns.get("dp_size"))
    assert (ns["model_path"], ns["host"], ns["port"], tp, dp) == ("/ckpt", "10.0.0.2", 30000, 2, 2)
    assert ns["enable_dp_attention"] and ns["enable_memory_saver"] and ns["random_seed"] == 7
    assert ns["api_key"] == "k" and ns["chunked_prefill_size"] == 2048 and ns["weight_version"] == "3"
    assert ns["custom_weight_loader"] == ["raygym.weightsync.loader.load_payload_via_model"]
    batch_sizes = ns.get("cuda_graph_bs_decode") or ns.get("cuda_graph_bs")
    assert batch_sizes == [1, 2, 4, 8]
    assert ns_cpu["device"] == "cpu" and ns_cpu["disable_overlap_schedule"] and ns_cpu["max_total_tokens"] > 0


def test_a_flag_a_release_lacks_is_refused_before_launch():
    with pytest.raises(ConfigError, match="0.5.6"):
        build_sglang_argv(Recipe(sglang_cuda_graph_backend_prefill="disabled"), model_path="/ckpt",
                          host="127.0.0.1", port=1, sglang_version="0.5.6")


@pytest.mark.timeout(600)
def test_minted_engine_api_keys_survive_sglangs_config_merge(sglang_python, tmp_path):
    """SGLang turns its config file into command-line arguments, so a key starting with '-' (one URL-safe key in
    64) read as an option and the engine refused to start; every key raygym mints must come through whole."""
    from raygym.engine_api.auth import new_engine_api_key
    from tests.sglang_cpu.conftest import sglang_home

    version = SUPPORTED_SGLANG[-1]
    keys = [new_engine_api_key() for _ in range(100)]
    argvs = []
    for i, key in enumerate(keys):
        config = tmp_path / f"config-{i}.yaml"
        config.write_text(render_sglang_config(Recipe(), api_key=key))
        argvs.append(["--model-path", "/ckpt", "--config", str(config)])
    assert [ns["api_key"] for ns in parse_with_sglang(sglang_python, sglang_home(), version, argvs)] == keys
    dashed = tmp_path / "dashed.yaml"
    dashed.write_text(render_sglang_config(Recipe(), api_key="-" + keys[0]))
    with pytest.raises(AssertionError, match="expected one argument"):
        parse_with_sglang(sglang_python, sglang_home(), version, [["--model-path", "/ckpt", "--config", str(dashed)]])
