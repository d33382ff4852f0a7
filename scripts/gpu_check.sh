#!/usr/bin/env bash
# The GPU checks, one script, bounded to 8 minutes in all; each section prints JSON lines and a failing
# section does not stop the next:
#   1. Megatron backend on one GPU (Qwen3-0.6B architecture, random weights, TP=1): train steps, HF
#      export, torch-backend log-prob parity, tokens/s and MFU (raygym/bench/gpu_check.py);
#   2. stock SGLang on the GPU: three verified weight syncs per transport (nccl, disk, ipc; delta over
#      disk) (raygym/bench/gpu_check_sglang.py; says so and moves on where SGLang is not installed);
#   3. vLLM (CUDA build) behind raygym's adapter: start-up, tokens/s against HF generate, log-prob mismatch,
#      verified syncs per transport (group, disk, ipc; deltas over group and disk) and sleep/wake
#      (raygym/bench/gpu_check_vllm.py; says so where vLLM is not installed: RAYGYM_VLLM_PYTHON names its
#      interpreter). It runs beside section 2 (small models, a quarter of the GPU's memory each; its
#      tokens/s shares the GPU with SGLang's check), so the script stays within 270 + 180 seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
timeout 270 python3 -m raygym.bench.gpu_check "$@" || echo '{"figure": "megatron_gpu_check", "exit": '$?'}'
vllm_out=$(mktemp)
timeout 180 python3 -m raygym.bench.gpu_check_vllm > "$vllm_out" 2> "$vllm_out.err" &
vllm_pid=$!
timeout 180 python3 -m raygym.bench.gpu_check_sglang || echo '{"figure": "sglang_gpu_check", "exit": '$?'}'
wait "$vllm_pid"; vllm_status=$?
cat "$vllm_out"
[ "$vllm_status" -eq 0 ] || { echo '{"figure": "vllm_gpu_check", "exit": '$vllm_status'}'; tail -n 20 "$vllm_out.err" >&2; }
rm -f "$vllm_out" "$vllm_out.err"
