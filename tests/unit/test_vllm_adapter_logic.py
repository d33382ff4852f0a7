"""The pure parts of raygym's vLLM engine kind: SGLang sampling params in vLLM's terms, answers in SGLang's
form, the adapter's command line, and what the kind declares (no vLLM needed)."""

from __future__ import annotations

import pytest

from raygym.config import Recipe
from raygym.engine_api.kinds import capabilities, check_weight_sync, weight_update_session
from raygym.engine_api.protocol import GenerateResponse
from raygym.engines.launch.vllm import build_vllm_argv, check_cpu_head_dim, max_model_len
from raygym.engines.serving.generate_route import SampleJob, per_item, prompt_batch, sample_answer
from raygym.engines.vllm.protocol import finish_reason, sampling_kwargs
from raygym.errors import ConfigError


def test_sampling_params_map_to_vllm_names():
    kwargs, n = sampling_kwargs({"max_new_tokens": 16, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9,
                                 "top_k": -1, "min_p": 0.05, "stop": "\n", "stop_token_ids": [1], "ignore_eos": True,
                                 "skip_special_tokens": False, "spaces_between_special_tokens": False,
                                 "no_stop_trim": True, "sampling_seed": 2**62, "n": 3, "repetition_penalty": 1.1,
                                 "stream_interval": 4, "logit_bias": {"5": -1}})
    assert n == 3 and "n" not in kwargs and "stream_interval" not in kwargs
    assert kwargs == {"max_tokens": 16, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
                      "stop": ["\n"], "stop_token_ids": [1], "ignore_eos": True, "skip_special_tokens": False,
                      "spaces_between_special_tokens": False, "include_stop_str_in_output": True,
                      "seed": 2**62, "repetition_penalty": 1.1, "logit_bias": {5: -1.0}}


def test_defaults_and_neutral_values():
    assert sampling_kwargs(None) == ({"max_tokens": 128}, 1)  # SGLang's default response length
    assert sampling_kwargs({"stop": [], "stop_token_ids": [], "logit_bias": {}, "top_k": None}) == ({"max_tokens": 128}, 1)


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"n": 0}, "n"), ({"temperature": "hot"}, "temperature"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"json_schema": "{}"}, "json_schema"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
])
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        sampling_kwargs(params)


def test_batches_and_per_item_values():
    assert prompt_batch([[1], [2, 3]], 10) == ([[1], [2, 3]], False)
    with pytest.raises(ValueError, match="vocab_size"):
        prompt_batch([1, 10], 10)
    with pytest.raises(ValueError, match="non-empty"):
        prompt_batch([[1], []], 10)
    assert per_item([True, False], 2, "return_logprob", bool, False) == [True, False]
    with pytest.raises(ValueError, match="one per prompt"):
        per_item([1], 2, "logprob_start_len", int, -1)
    with pytest.raises(ValueError, match="logprob_start_len"):
        per_item(True, 2, "logprob_start_len", int, -1)  # a bool is not an int here


def test_answers_validate_as_the_protocol_says():
    eos = finish_reason("stop", None, eos_token_id=1, completion_tokens=2)
    job = SampleJob(0, "r1", 0, 1, [3, 4, 5], {}, True, 1, None, False)
    answer = sample_answer(job, text="x", output_ids=[7, 1], finish=eos, weight_version="4",
                           output_logprobs=[-0.25, -1.5], prompt_logprobs=[None, -2.0, -3.0])
    parsed = GenerateResponse.model_validate(answer)
    assert parsed.meta_info.finish_reason.type == "stop" and parsed.meta_info.finish_reason.matched == 1
    assert parsed.meta_info.output_token_logprobs == [[-0.25, 7, None], [-1.5, 1, None]]
    assert parsed.meta_info.input_token_logprobs == [[-2.0, 4, None], [-3.0, 5, None]]
    assert parsed.meta_info.weight_version == "4" and parsed.meta_info.completion_tokens == 2
    unasked = SampleJob(0, "r", 0, 1, [3], {}, False, -1, None, False)
    without = sample_answer(unasked, text="", output_ids=[4], finish=eos, weight_version="0")
    assert "output_token_logprobs" not in without["meta_info"]
    with pytest.raises(ValueError, match="log-probs"):
        sample_answer(SampleJob(0, "r", 0, 1, [3], {}, True, -1, None, False), text="", output_ids=[4, 5],
                      finish=eos, weight_version="0", output_logprobs=[-1.0])
    assert finish_reason("stop", 9, eos_token_id=1, completion_tokens=1) == {"type": "stop", "matched": 9}
    assert finish_reason(None, None, eos_token_id=1, completion_tokens=0)["type"] == "abort"


def test_adapter_command_line_from_the_recipe():
    recipe = Recipe(rollout_num_gpus_per_engine=2, sglang_mem_fraction_static=0.5, sglang_max_running_requests=32,
                    seed=7, rollout_max_prompt_len=100, rollout_max_response_len=50, eval_interval=None,
                    update_weight_timeout=30.0)
    argv = build_vllm_argv(recipe, model_path="/m", host="10.0.0.2", port=1234, python="/venv/python",
                           device="cuda", weight_version=3, extra_args=["--enforce-eager"])
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[:3] == ["/venv/python", "-m", "raygym.engines.vllm.server"]
    assert flags["--tensor-parallel-size"] == "2" and flags["--gpu-memory-utilization"] == "0.5"
    assert flags["--max-num-seqs"] == "32" and flags["--seed"] == "7" and flags["--max-model-len"] == "150"
    assert flags["--weight-version"] == "3" and flags["--weight-update-timeout"] == "30.0"
    assert "--enable-sleep-mode" in argv  # colocated on GPU: release must free memory
    assert argv[-1] == "--enforce-eager" and not any("key" in a.lower() for a in argv)
    cpu = build_vllm_argv(recipe, model_path="/m", host="127.0.0.1", port=1, device="cpu")
    assert "--enable-sleep-mode" not in cpu
    assert "--enable-sleep-mode" not in build_vllm_argv(recipe.replace(colocate=False), model_path="/m",
                                                         host="127.0.0.1", port=1, device="cuda")
    with pytest.raises(ConfigError, match="0.0.0.0"):
        build_vllm_argv(recipe, model_path="/m", host="0.0.0.0", port=1)
    assert max_model_len(Recipe(rollout_max_response_len=10, eval_max_response_len=30, eval_interval=5)) == 1024 + 30


def test_cpu_head_sizes():
    check_cpu_head_dim(32, "/m")
    check_cpu_head_dim(None, "/m")  # unknown: vLLM itself will say
    with pytest.raises(ConfigError, match="head_dim=16"):
        check_cpu_head_dim(16, "/m")


def test_the_vllm_kind_declares_probe_verification_and_its_transports():
    caps = capabilities("vllm")
    assert caps.verification == "probe" and caps.dist_format == "flattened_bucket"
    assert caps.full_transports == {"nccl", "disk", "ipc"} and caps.delta_transports == {"nccl", "disk"}
    assert weight_update_session("vllm", "0.32.0") and weight_update_session("vllm", None)
    check_weight_sync("vllm", mode="delta", transport="nccl", colocate=False)
    with pytest.raises(ConfigError, match="CUDA IPC ships handles"):
        check_weight_sync("vllm", mode="delta", transport="ipc", colocate=True)
    Recipe(rollout_engine="vllm", update_weight_mode="delta", update_weight_transport="disk",
           update_weight_disk_dir="/tmp/x", colocate=False)  # accepted at config time
