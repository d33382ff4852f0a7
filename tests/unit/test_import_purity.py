"""Which heavy libraries importing each raygym module may load, checked in a fresh interpreter per module.

Two tiers, chosen per module below:
- NO_TORCH_NO_RAY: the configuration, layout maths, protocol and CLI planning surface. `raygym plan` and
  config validation must work on a machine without torch or Ray, and stay instant.
- NO_RAY: pure tensor maths (losses, advantages, the weight codec). torch is their subject, but Ray
  belongs at the edges (actors, drivers), never in a module that only computes.
Every probe also forbids the optional engines and ``modal`` (transformers only in the first tier): only the Modal
launcher (raygym/launchers/modal_app.py, never probed) imports ``modal``; tests/unit/test_import_graph.py checks
that nothing else imports it.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import raygym

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(raygym.__file__).parent

NO_TORCH_NO_RAY = ("torch", "ray", "transformers", "sglang", "vllm", "modal")
NO_RAY = ("ray", "sglang", "vllm", "modal")


def submodules(package: str) -> list[str]:
    """The modules of a raygym subpackage, found on disk so that a new file is checked without edits."""
    folder = PACKAGE_DIR.joinpath(*package.split(".")[1:])
    return sorted(f"{package}.{info.name}" for info in pkgutil.iter_modules([str(folder)]))


# The package `raygym.algo` imports torch in its __init__, so even its torch-free files (batching)
# load torch when imported by their dotted name; every algo module is therefore in the NO_RAY tier.
ALGO_TIERS = {
    "raygym.algo": NO_RAY,
    "raygym.algo.advantages": NO_RAY,
    "raygym.algo.batching": NO_RAY,
    "raygym.algo.kl": NO_RAY,
    "raygym.algo.losses": NO_RAY,
    "raygym.algo.mismatch": NO_RAY,
    "raygym.algo.rl_loss": NO_RAY,
}

PROBES: dict[str, tuple[str, tuple[str, ...]]] = {
    **{name: (f"import {name}", NO_TORCH_NO_RAY) for name in ["raygym.config", *submodules("raygym.config")]},
    **{
        name: (f"import {name}", NO_TORCH_NO_RAY)
        for name in [
            "raygym",
            "raygym.errors",
            "raygym.callables",
            "raygym.config.allocation",
            "raygym.cluster.layout",
            "raygym.cluster.placement",
            "raygym.cluster.actor_group",
            "raygym.presets",
            "raygym.cli.main",
            "raygym.cli.submit",
            "raygym.launchers",
            "raygym.launchers.bootstrap",
            "raygym.launchers.modal_config",
            "raygym.launchers.ray_job",
            "raygym.launchers.source",
            "raygym.engine_api.protocol",
            "raygym.engine_api.kinds",
        ]
    },
    **{name: (f"import {name}", tier) for name, tier in ALGO_TIERS.items()},
    "raygym.weightsync.codec": ("import raygym.weightsync.codec", NO_RAY),
    "raygym.weightsync.in_place": ("import raygym.weightsync.in_place", NO_RAY),
    "public API names": ("from raygym import Recipe, TrainConfig, presets", NO_TORCH_NO_RAY),
    "raygym plan": (
        "from raygym.cli.main import main\nassert main(['plan', '--preset', 'qwen3-30b-a3b']) == 0",
        NO_TORCH_NO_RAY,
    ),
    "raygym submit --help": ("from raygym.cli.main import main\nassert main(['submit', '--help']) == 0", NO_TORCH_NO_RAY),
}


def probe_code(code: str, watched: tuple[str, ...]) -> str:
    return (
        f"{code}\nimport sys\n"
        f"print('LOADED:', *sorted({{m.split('.')[0] for m in sys.modules}} & set({watched!r})))"
    )


def loaded_from(done: subprocess.CompletedProcess) -> list[str]:
    """The watched top-level packages a finished probe reported in its sys.modules."""
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("LOADED:"), done.stdout
    return last.split()[1:]


def run_probe(code: str, watched: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", probe_code(code, watched)], capture_output=True, text=True, timeout=300, cwd=REPO
    )


@pytest.fixture(scope="module")
def probe_results() -> dict[str, subprocess.CompletedProcess]:
    """Every probe, each in its own fresh interpreter, run a few at a time (the imports are CPU-bound)."""
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(run_probe, code, forbidden) for name, (code, forbidden) in PROBES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_import_loads_no_forbidden_library(name: str, probe_results) -> None:
    forbidden = PROBES[name][1]
    assert loaded_from(probe_results[name]) == [], f"{name} must not load {forbidden}"


def test_every_algo_module_has_a_declared_tier() -> None:
    assert sorted(ALGO_TIERS) == sorted(["raygym.algo", *submodules("raygym.algo")])


def test_the_probe_sees_a_module_level_import() -> None:
    assert loaded_from(run_probe("import json, ray", NO_TORCH_NO_RAY)) == ["ray"]
