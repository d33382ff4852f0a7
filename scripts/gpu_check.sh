#!/usr/bin/env bash
# The GPU checks, one script, bounded to 8 minutes in all (270 + 180 seconds); each section prints JSON lines and
# a failing section does not stop the next:
#   1. Megatron backend on one GPU (Qwen3-0.6B architecture, random weights, TP=1): train steps, HF
#      export, torch-backend log-prob parity, tokens/s and MFU (raygym/bench/gpu_check.py);
#   2. stock SGLang on the GPU: three verified weight syncs per transport (nccl, disk, ipc; delta over
#      disk) (raygym/bench/gpu_check_sglang.py; says so and moves on where SGLang is not installed);
#   3. vLLM (CUDA build) behind raygym's adapter: start-up, tokens/s against HF generate, log-prob mismatch,
#      verified syncs per transport (group, disk, ipc; deltas over group and disk) and sleep/wake
#      (raygym/bench/gpu_check_vllm.py; says so where vLLM is not installed: RAYGYM_VLLM_PYTHON names its
#      interpreter). It runs beside section 2 (small models, a quarter of the GPU's memory each; its
#      tokens/s shares the GPU with SGLang's check), so the two take 180 seconds;
#   4. a vision-language model (the builtin tiny Qwen2.5-VL) on each installed engine, stock SGLang then
#      vLLM: an image prompt's log-probs against HF transformers' forward pass on the GPU, and one verified
#      weight sync over disk (raygym/bench/gpu_check_vlm.py; says so where there is no CUDA device or an
#      engine is not installed). It runs beside section 1 (a tiny model, a fifth of the GPU's memory at
#      most), within its 270 seconds; its lines follow section 1's.
set -uo pipefail
cd "$(dirname "$0")/.."
vlm_out=$(mktemp)
timeout 240 python3 -m raygym.bench.gpu_check_vlm > "$vlm_out" 2> "$vlm_out.err" &
vlm_pid=$!
timeout 270 python3 -m raygym.bench.gpu_check "$@" || echo '{"figure": "megatron_gpu_check", "exit": '$?'}'
wait "$vlm_pid"; vlm_status=$?
cat "$vlm_out"
[ "$vlm_status" -eq 0 ] || { echo '{"figure": "vlm_gpu_check", "exit": '$vlm_status'}'; tail -n 20 "$vlm_out.err" >&2; }
rm -f "$vlm_out" "$vlm_out.err"
vllm_out=$(mktemp)
timeout 180 python3 -m raygym.bench.gpu_check_vllm > "$vllm_out" 2> "$vllm_out.err" &
vllm_pid=$!
timeout 180 python3 -m raygym.bench.gpu_check_sglang || echo '{"figure": "sglang_gpu_check", "exit": '$?'}'
wait "$vllm_pid"; vllm_status=$?
cat "$vllm_out"
[ "$vllm_status" -eq 0 ] || { echo '{"figure": "vllm_gpu_check", "exit": '$vllm_status'}'; tail -n 20 "$vllm_out.err" >&2; }
rm -f "$vllm_out" "$vllm_out.err"
