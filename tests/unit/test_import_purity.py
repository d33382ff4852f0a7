"""Configuration, presets and `raygym plan` import neither torch nor ray (fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "ray", "transformers", "modal", "sglang")


def modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint('HEAVY:', *sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY:"), out.stdout
    return set(last.split()[1:])


def test_import_config_is_light():
    assert modules_after("import raygym.config") == set()


def test_import_package_and_presets_is_light():
    assert (
        modules_after("import raygym, raygym.presets\nfrom raygym import Recipe, TrainConfig, presets")
        == set()
    )


def test_plan_is_light():
    code = "from raygym.cli import main\nassert main(['plan', '--preset', 'qwen3-30b-a3b']) == 0"
    assert modules_after(code) == set()
