#!/usr/bin/env bash
# Stock, unpatched SGLang 0.5.18 with its CPU backend, in a virtual environment of its own, for the tests
# marked sglang_cpu and for `raygym train --rollout-engine sglang --rollout-engine-python <venv>/bin/python`
# on a machine without GPUs.
#
#   bash scripts/install_sglang_cpu.sh [DEST]        (default DEST: .venvs/sglang-cpu)
#
# SGLang needs its own interpreter: it pins the CUDA build of torch 2.13.0 (which runs without a GPU) and
# imports torchvision, whose PyPI wheel needs that build. Its CPU kernels (sgl_kernel) are not on PyPI:
# they are built here from third_party/sglang-kernel-cpu (see its README): ~5 minutes on 2 cores, once per
# machine: the wheel is kept in ~/.cache/raygym/sgl-kernel-cpu/<version, ISA, torch, source hash>/.
# DEST/args/<version>/ also receives the sglang package of every release the sglang extra allows, for
# checking raygym's launch flags with each release's own argument parser.
# Exit status 3: this machine cannot run SGLang's CPU backend (not x86-64 with AVX2); the reason is printed.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$(mkdir -p "${1:-$REPO/.venvs/sglang-cpu}" && cd "${1:-$REPO/.venvs/sglang-cpu}" && pwd)
SGLANG_VERSION=0.5.18
ARG_VERSIONS="0.5.6 0.5.15.post1 0.5.18 0.5.23"
# PyPI's torch 2.13.0 is the CUDA build SGLang pins; this machine's pip may point at a local CPU-only
# torch wheel, which SGLang cannot use (its torchvision needs the CUDA libraries).
export PIP_FIND_LINKS=/nonexistent PIP_DISABLE_PIP_VERSION_CHECK=1
pipq() { "$DEST/venv/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
say() { echo "install_sglang_cpu: $*" >&2; }

if [ "$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo; then
  say "SGLang's CPU backend needs an x86-64 CPU with AVX2; this machine is $(uname -m) without it"; exit 3
fi
if grep -qw amx_bf16 /proc/cpuinfo && grep -qw avx512f /proc/cpuinfo; then ISA=amx; else ISA=avx2; fi
command -v g++ >/dev/null || { apt-get update -q && apt-get install -y -q g++; }
[ -e /usr/lib/x86_64-linux-gnu/libnuma.so ] || { apt-get update -q && apt-get install -y -q libnuma-dev; }

if [ ! -x "$DEST/venv/bin/python" ]; then python3.11 -m venv "$DEST/venv"; fi
printf 'torch==2.13.0\ntorchvision==0.28.0\n' > "$DEST/constraints.txt"
say "torch (CUDA build, runs on CPU) and build tools"
pipq -c "$DEST/constraints.txt" torch==2.13.0 torchvision==0.28.0 scikit-build-core wheel cmake ninja numpy

# The built kernel is kept outside the clone, keyed by what it was built from, so a later clone (or CI run on
# the same machine) installs it in seconds; a fresh machine builds it once.
KERNEL_SRC="$REPO/third_party/sglang-kernel-cpu/sgl-kernel-cpu-src-v$SGLANG_VERSION.tar.gz"
KERNEL_KEY="v$SGLANG_VERSION-$ISA-torch2.13.0-py311-$(sha256sum "$KERNEL_SRC" | cut -c1-12)"
KERNEL_CACHE="${RAYGYM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/raygym}/sgl-kernel-cpu/$KERNEL_KEY"
if ! "$DEST/venv/bin/python" -c "import sgl_kernel" 2>/dev/null && compgen -G "$KERNEL_CACHE/sglang_kernel_cpu-*.whl" >/dev/null; then
  say "SGLang's CPU kernels from the cache ($KERNEL_CACHE)"
  pipq --no-deps "$KERNEL_CACHE"/sglang_kernel_cpu-*.whl
fi
if ! "$DEST/venv/bin/python" -c "import sgl_kernel" 2>/dev/null; then
  say "building SGLang's CPU kernels for $ISA"
  KB="$DEST/kernel-build"; rm -rf "$KB"; mkdir -p "$KB/cmake"
  tar xzf "$KERNEL_SRC" -C "$KB"
  cp "$KB/aot/pyproject_cpu.toml" "$KB/aot/pyproject.toml"
  TORCH_DIR=$("$DEST/venv/bin/python" -c "import torch, os; print(os.path.dirname(torch.__file__))")
  # find_package(Torch) on the CUDA torch wheel demands a CUDA toolkit: give CMake a CPU-only view of it.
  cat > "$KB/cmake/TorchConfig.cmake" <<CMAKE
set(TORCH_INSTALL_PREFIX "$TORCH_DIR")
set(TORCH_INCLUDE_DIRS "$TORCH_DIR/include" "$TORCH_DIR/include/torch/csrc/api/include")
find_library(TORCH_LIBRARY torch PATHS "$TORCH_DIR/lib" NO_DEFAULT_PATH REQUIRED)
find_library(TORCH_CPU_LIBRARY torch_cpu PATHS "$TORCH_DIR/lib" NO_DEFAULT_PATH REQUIRED)
find_library(C10_LIBRARY c10 PATHS "$TORCH_DIR/lib" NO_DEFAULT_PATH REQUIRED)
set(TORCH_LIBRARIES \${TORCH_LIBRARY} \${TORCH_CPU_LIBRARY} \${C10_LIBRARY})
set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")
add_compile_options(-D_GLIBCXX_USE_CXX11_ABI=1 -std=c++20)
set(Torch_FOUND TRUE)
CMAKE
  CXX_BIN=$(command -v g++)
  if [ "$ISA" = avx2 ]; then
    # SGLang's CMakeLists hard-codes -march=x86-64-v4 and AMX flags; its kernels guard their AVX-512 code,
    # so for an AVX2 CPU the same sources build once those flags are swapped for x86-64-v3.
    cat > "$KB/cxx" <<'WRAP'
#!/usr/bin/env bash
args=()
for a in "$@"; do
  case "$a" in -march=x86-64-v4) args+=(-march=x86-64-v3) ;; -mavx512*|-mamx*) ;; *) args+=("$a") ;; esac
done
exec g++ "${args[@]}"
WRAP
    chmod +x "$KB/cxx"; CXX_BIN="$KB/cxx"
  fi
  ( cd "$KB/aot" && CXX="$CXX_BIN" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$DEST/venv/bin/python" -m pip wheel -q \
      --no-build-isolation --no-deps -w "$KB/wheels" --config-settings=build-dir="$KB/build" \
      --config-settings=cmake.define.Torch_DIR="$KB/cmake" --config-settings=cmake.define.CMAKE_CXX_COMPILER="$CXX_BIN" . )
  pipq --no-deps "$KB"/wheels/sglang_kernel_cpu-*.whl
  mkdir -p "$KERNEL_CACHE" && cp "$KB"/wheels/sglang_kernel_cpu-*.whl "$KERNEL_CACHE"/ || \
    say "could not keep the built kernel in $KERNEL_CACHE (the next install builds it again)"
  rm -rf "$KB/build"
fi

say "sglang $SGLANG_VERSION and what its CPU server imports"
pipq --no-deps "sglang==$SGLANG_VERSION"
pipq -c "$DEST/constraints.txt" "transformers==5.12.1" aiohttp fastapi uvicorn uvloop "pyzmq>=25.1.2" orjson \
  pybase64 psutil setproctitle msgspec requests scipy pillow packaging pydantic python-multipart \
  "prometheus-client>=0.20.0" partial_json_parser interegular "xgrammar==0.2.1" sentencepiece tiktoken einops \
  "openai==2.6.1" "openai-harmony==0.0.4" "anthropic>=0.20.0" xxhash zstandard watchfiles safetensors tqdm \
  distro regex IPython dill compressed-tensors gguf jsonschema "soundfile==0.13.1" fsspec

say "the sglang package of $ARG_VERSIONS (argument parsers)"
for v in $ARG_VERSIONS; do
  if [ ! -d "$DEST/args/$v/sglang" ]; then
    mkdir -p "$DEST/args/$v"
    "$DEST/venv/bin/python" -m pip download -q --no-deps "sglang==$v" -d "$DEST/args/$v/wheel" 2>&1 | grep -v "^WARNING: Location" || true
    "$DEST/venv/bin/python" -c "import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]).extractall(sys.argv[1], [n for n in zipfile.ZipFile(glob.glob(sys.argv[1] + '/wheel/*.whl')[0]).namelist() if n.startswith('sglang/')])" "$DEST/args/$v"
    rm -rf "$DEST/args/$v/wheel"
  fi
done

"$DEST/venv/bin/python" -c "import sgl_kernel, sglang.srt.server_args; print('sglang', __import__('importlib.metadata').metadata.version('sglang'))"
echo "$DEST/venv/bin/python"
