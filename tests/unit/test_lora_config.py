"""LoRA's configuration, names, files and engine flags (pure parts of raygym/lora.py, raygym/engines/launch/lora.py,
the capability table), and `raygym train` refusing bad LoRA input before Ray starts (exit 2, one line naming the
fix)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raygym.config import Recipe, TrainConfig
from raygym.engine_api.kinds import capabilities, check_lora
from raygym.engines.launch.lora import adapter_request_fields, engine_lora_args
from raygym.engines.vllm.lora import lora_engine_args, vllm_lora_rank
from raygym.errors import ConfigError
from raygym.lora import (
    LoraSpec,
    adapter_config,
    model_targets,
    parse_target_modules,
    read_adapter,
    resolve_targets,
    split_tensor_name,
    write_adapter,
)
from raygym.run.config_loading import load_train_config

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN_LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


@pytest.mark.parametrize("fields, needles", [
    ({"lora_rank": -1}, ["lora_rank=-1", "--lora-rank 8"]),
    ({"lora_target_modules": "q_proj"}, ["lora_target_modules='q_proj'", "lora_rank=0", "--lora-rank"]),
    ({"lora_alpha": 32}, ["lora_alpha=32", "lora_rank=0"]),
    ({"lora_dropout": 0.1}, ["lora_dropout=0.1", "lora_rank=0"]),
    ({"lora_rank": 8, "lora_target_modules": "all-linear,q_proj"}, ["'all-linear' already names"]),
    ({"lora_rank": 8, "lora_target_modules": "q_proj;v_proj"}, ["'q_proj;v_proj' is not a module name"]),
    ({"lora_rank": 8, "lora_target_modules": " , "}, ["lora_target_modules=''", "all-linear"]),
    ({"lora_rank": 8, "lora_alpha": 0}, ["lora_alpha=0", "--lora-alpha 16"]),
    ({"lora_rank": 8, "lora_dropout": 1.0}, ["lora_dropout=1.0", "--lora-dropout"]),
    ({"lora_rank": 8, "trainer_backend": "megatron"}, ["trainer_backend='megatron'", "--trainer-backend torch"]),
    ({"lora_rank": 8, "tensor_model_parallel_size": 2}, ["tensor_model_parallel_size=2", "--trainer-backend torch"]),
    ({"lora_rank": 8, "freeze_params_name_list": ["embed"]}, ["freeze_params_name_list", "--lora-rank 0"]),
    ({"lora_rank": 8, "use_critic": True, "advantage_estimator": "ppo"}, ["use_critic=True", "grpo"]),
    ({"lora_rank": 8, "rollout_engine": "vllm", "colocate": False, "update_weight_mode": "delta"},
     ["update_weight_mode='delta'", "--update-weight-mode full"]),
])
def test_bad_lora_settings_are_config_errors_naming_the_fix(fields, needles):
    with pytest.raises(ConfigError) as err:
        Recipe(**fields)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_lora_settings_that_work():
    recipe = Recipe(lora_rank=16, lora_alpha=32, lora_dropout=0.05, lora_target_modules=["q_proj", "v_proj"])
    assert recipe.lora_target_modules == "q_proj,v_proj"  # PEFT's list form, kept as one string
    assert recipe.check_trainer_backend() == "torch"  # auto picks the torch backend: only it trains LoRA
    spec = LoraSpec.from_recipe(recipe)
    assert spec == LoraSpec(16, 32.0, 0.05, ("q_proj", "v_proj")) and spec.scaling == 2.0
    assert LoraSpec.from_recipe(Recipe()) is None
    Recipe(lora_rank=8, rollout_engine="raygym", colocate=False, update_weight_mode="delta")  # raygym takes deltas
    cfg = load_train_config(["--preset", "tiny", "--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"])
    assert TrainConfig.from_cli_args(cfg.cli_args()) == cfg
    assert (cfg.recipe.lora_rank, cfg.recipe.lora_target_modules) == (8, "q_proj,v_proj")


def test_targets_resolve_like_peft():
    spec = LoraSpec(8, 16, 0.0, ("all-linear",))
    assert resolve_targets(spec, QWEN_LINEARS) == QWEN_LINEARS[:-1]  # every linear layer but the output head
    some = resolve_targets(LoraSpec(8, 16, 0.0, ("q_proj", "mlp.up_proj")), QWEN_LINEARS)
    assert some == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
                    "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"]
    with pytest.raises(ConfigError, match=r"'embed_tokens' is not a linear layer of this model; its linear layers "
                                          r"are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        resolve_targets(LoraSpec(8, 16, 0.0, ("q_proj", "embed_tokens")), QWEN_LINEARS)
    assert parse_target_modules(" q_proj ,v_proj") == ("q_proj", "v_proj")


def test_targets_of_a_checkpoint_are_found_without_reading_its_weights(tiny_model_path):
    targets = model_targets(tiny_model_path, LoraSpec(4, 8, 0.0, ("all-linear",)))
    assert targets == QWEN_LINEARS[:-1]
    with pytest.raises(ConfigError, match="'w_proj' is not a linear layer"):
        model_targets(tiny_model_path, LoraSpec(4, 8, 0.0, ("w_proj",)))


def test_adapter_names_and_files_are_pefts(tmp_path):
    assert split_tensor_name("model.layers.0.self_attn.q_proj.lora_A.weight") == ("model.layers.0.self_attn.q_proj", "A")
    with pytest.raises(ValueError, match="not a LoRA tensor name"):
        split_tensor_name("model.layers.0.self_attn.q_proj.weight")
    spec = LoraSpec(4, 8, 0.0, ("all-linear",))
    config = adapter_config(spec, "/models/base", QWEN_LINEARS[:2])
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"]) == \
        ("LORA", 4, 8, ["k_proj", "q_proj"])
    assert isinstance(config["lora_alpha"], int) and config["base_model_name_or_path"] == "/models/base"
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
               "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4)}
    out = write_adapter(tmp_path / "a", config, tensors)
    from safetensors import safe_open

    with safe_open(str(Path(out) / "adapter_model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    read_config, read_tensors = read_adapter(out)
    assert read_config == config and all(torch.equal(read_tensors[n], t) for n, t in tensors.items())
    assert LoraSpec.from_config(read_config) == LoraSpec(4, 8.0, 0.0, ("k_proj", "q_proj"))
    with pytest.raises(ConfigError, match="use_dora"):
        LoraSpec.from_config({**config, "use_dora": True})
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        read_adapter(tmp_path)


def test_each_engine_kind_declares_how_it_serves_adapters():
    assert capabilities("raygym").lora == "weights"
    assert capabilities("sglang").lora == "lora_endpoints" and not capabilities("sglang").lora_on_cpu
    assert capabilities("vllm").lora == "lora_endpoints" and capabilities("vllm").lora_replace
    check_lora("raygym", mode="delta", double_buffer=True, cuda=False)
    check_lora("vllm", mode="auto", double_buffer=False, cuda=False)
    check_lora("sglang", mode="full", double_buffer=False, cuda=True)
    with pytest.raises(ConfigError, match=r"SGLang's CPU backend cannot serve LoRA adapters .*pin host memory.*"
                                          r"--rollout-engine vllm .* or --rollout-engine raygym"):
        check_lora("sglang", mode="full", double_buffer=False, cuda=False)
    with pytest.raises(ConfigError, match="update_weight_double_buffer"):
        check_lora("vllm", mode="full", double_buffer=True)


def test_engine_flags_and_request_fields():
    spec = LoraSpec(4, 8, 0.0, ("all-linear",))
    assert engine_lora_args("raygym", spec, QWEN_LINEARS[:-1]) == ["--lora-config", spec.to_json()]
    assert engine_lora_args("raygym", spec, [], "/a") == ["--lora-adapter", "/a"]
    assert engine_lora_args("vllm", spec, [], "/a") == ["--lora-rank", "4", "--lora-adapter", "/a"]
    assert engine_lora_args("sglang", spec, QWEN_LINEARS[:-1], "/a") == [
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "down_proj", "gate_proj", "k_proj",
        "o_proj", "q_proj", "up_proj", "v_proj", "--max-loras-per-batch", "1", "--lora-paths", "raygym-policy=/a"]
    assert (vllm_lora_rank(4), vllm_lora_rank(16), vllm_lora_rank(17)) == (8, 16, 32)
    assert lora_engine_args(4) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 2}
    assert adapter_request_fields(Recipe(lora_rank=4, rollout_engine="vllm", colocate=False)) == \
        {"lora_path": "raygym-policy"}
    assert adapter_request_fields(Recipe(lora_rank=4, rollout_engine="raygym")) == {}
    assert adapter_request_fields(Recipe(rollout_engine="vllm")) == {}


def _train(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "raygym", "train", "--output-dir", str(tmp_path / "run"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


@pytest.mark.slow  # a `raygym train` subprocess each
@pytest.mark.parametrize("flags, needles", [
    (["--lora-target-modules", "q_proj"], ["lora_target_modules='q_proj' but lora_rank=0", "--lora-rank 8"]),
    (["--lora-rank", "8", "--lora-target-modules", "q_proj,w_proj"],
     ["'w_proj' is not a linear layer of this model", "all-linear"]),
    (["--lora-rank", "8", "--rollout-engine", "sglang", "--rollout-engine-python", sys.executable],
     ["SGLang's CPU backend cannot serve LoRA adapters", "--rollout-engine vllm"]),
    (["--lora-rank", "8", "--trainer-backend", "megatron"], ["LoRA trains on the torch backend only",
                                                            "--trainer-backend torch"]),
])
def test_bad_lora_input_exits_2_before_ray_starts(tmp_path, flags, needles):
    import torch as _torch

    if "sglang" in flags and _torch.cuda.is_available():
        pytest.skip("SGLang serves LoRA on GPUs")
    done, elapsed = _train(tmp_path, *flags)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert elapsed < 30, f"took {elapsed:.1f}s"
    err = done.stderr
    assert err.startswith("raygym: error: ") and err.count("\n") == 1, err
    assert "Started a local Ray instance" not in done.stdout + err and not (tmp_path / "run" / "metrics.jsonl").exists()
    for needle in needles:
        assert needle in err, (needle, err)
