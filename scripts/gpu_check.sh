#!/usr/bin/env bash
# The GPU checks, one script, bounded to 8 minutes in all; each section prints JSON lines and a failing
# section does not stop the next:
#   1. Megatron backend on one GPU (Qwen3-0.6B architecture, random weights, TP=1): train steps, HF
#      export, torch-backend log-prob parity, tokens/s and MFU (benchmarks/gpu_check.py);
#   2. stock SGLang on the GPU: three verified weight syncs per transport (nccl, disk, ipc; delta over
#      disk) (benchmarks/gpu_check_sglang.py; says so and moves on where SGLang is not installed).
set -uo pipefail
cd "$(dirname "$0")/.."
timeout 270 python3 benchmarks/gpu_check.py "$@" || echo '{"figure": "megatron_gpu_check", "exit": '$?'}'
timeout 180 python3 benchmarks/gpu_check_sglang.py || echo '{"figure": "sglang_gpu_check", "exit": '$?'}'
