#!/usr/bin/env bash
# raygym as users install it: a wheel built from this checkout, installed into a fresh virtual environment
# (torch 2.13.0 first, as the README says), for the tests that run `raygym train` against real engines from
# an installed package rather than the checkout.
#
#   bash scripts/install_wheel_venv.sh [DEST]        (default DEST: .venvs/wheel; prints DEST/venv/bin/python)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$(mkdir -p "${1:-$REPO/.venvs/wheel}" && cd "${1:-$REPO/.venvs/wheel}" && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "install_wheel_venv: $*" >&2; }

rm -rf "$DEST/venv" "$DEST/dist"
say "building raygym's wheel from $REPO"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DEST/dist" "$REPO" 2>&1 | grep -v "^WARNING: Location" >&2 || true
WHEEL=$(ls "$DEST"/dist/raygym-*.whl)
python3.11 -m venv "$DEST/venv"
say "a fresh venv: torch 2.13.0, then $(basename "$WHEEL")"
"$DEST/venv/bin/python" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" >&2 || true
"$DEST/venv/bin/python" -m pip install -q "$WHEEL" 2>&1 | grep -v "^WARNING: Location" >&2 || true
# From outside the checkout: the package must come from the venv's site-packages, not from $REPO.
( cd "$DEST" && env -u PYTHONPATH "$DEST/venv/bin/python" - "$DEST" <<'PY'
import sys, raygym
assert raygym.__file__.startswith(sys.argv[1]), f"raygym imported from {raygym.__file__}, not the venv"
print("raygym from", raygym.__file__, file=sys.stderr)
PY
)
echo "$DEST/venv/bin/python"
