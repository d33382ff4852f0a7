"""LoRA and stock SGLang: the flags raygym launches SGLang with for a LoRA run are SGLang's own (parsed by every
release the ``sglang`` extra allows); SGLang's CPU backend cannot serve adapters (its LoRA layers pin host memory,
which needs a CUDA driver: shown by launching it with those flags), so ``raygym train --lora-rank 8
--rollout-engine sglang`` stops on a CPU before Ray starts, naming the engines that can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raygym.config import Recipe
from raygym.engines.launch.lora import engine_lora_args
from raygym.engines.launch.sglang import SUPPORTED_SGLANG, build_sglang_argv
from raygym.lora import ADAPTER_NAME, LoraSpec
from raygym.weightsync.transport_dist import free_port
from tests.sglang_cpu.test_launch_flags import parse_with_sglang

pytestmark = pytest.mark.sglang_cpu

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
SPEC = LoraSpec(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_sglangs_parser_accepts_the_lora_flags(version, sglang_python):
    from tests.sglang_cpu.conftest import sglang_home

    recipe = Recipe(rollout_num_gpus_per_engine=1, actor_num_gpus_per_node=8, lora_rank=8)
    argvs = [build_sglang_argv(recipe, model_path="/ckpt", host="10.0.0.2", port=30000, sglang_version=version,
                               extra_args=engine_lora_args("sglang", SPEC, TARGETS, adapter))[3:]
             for adapter in (None, "/runs/r/adapter")]
    fresh, served = parse_with_sglang(sglang_python, sglang_home(), version, argvs)
    for parsed in (fresh, served):
        assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 8 and parsed["max_loras_per_batch"] == 1
        assert sorted(parsed["lora_target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert fresh["lora_paths"] in (None, [])
    assert ADAPTER_NAME in str(served["lora_paths"]) and "/runs/r/adapter" in str(served["lora_paths"])


@pytest.mark.timeout(600)
def test_sglangs_cpu_backend_dies_on_lora_layers_that_pin_memory(sglang_python, sglang_model, tmp_path):
    """What raygym refuses LoRA on SGLang's CPU backend for, shown: launched with raygym's LoRA flags, SGLang's
    CPU backend exits while it wraps the model's layers (sglang/srt/lora/layers.py pins host memory)."""
    recipe = Recipe(rollout_engine="sglang", colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                    lora_rank=8, lora_target_modules="q_proj,v_proj,down_proj", rollout_max_response_len=8,
                    eval_interval=None)
    port = free_port("127.0.0.1")
    argv = build_sglang_argv(recipe, model_path=sglang_model, host="127.0.0.1", port=port, python=sglang_python,
                             sglang_version="0.5.18", device="cpu", custom_weight_loaders=(), skip_server_warmup=True,
                             extra_args=engine_lora_args("sglang", SPEC, TARGETS))
    log = tmp_path / "sglang.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
        try:
            code = proc.wait(timeout=540)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert "sglang/srt/lora/layers.py" in text and "NVIDIA driver" in text, text[-3000:]


@pytest.mark.timeout(300)
def test_lora_on_sglangs_cpu_backend_stops_before_ray(sglang_python, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "raygym", "train", "--lora-rank", "8", "--rollout-engine", "sglang",
                           "--rollout-engine-python", sglang_python, "--output-dir", str(tmp_path / "run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "SGLang's CPU backend cannot serve LoRA adapters" in done.stderr
    assert "--rollout-engine vllm" in done.stderr and "--rollout-engine raygym" in done.stderr
    assert "Started a local Ray instance" not in done.stdout + done.stderr
