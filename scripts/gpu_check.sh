#!/usr/bin/env bash
# One-GPU check of the Megatron backend (Qwen3-0.6B architecture, random weights, TP=1):
# train steps, HF export, torch-backend log-prob parity; prints JSON lines. Bounded to 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python3 benchmarks/gpu_check.py "$@"
