"""pytest at the repository root: the doctests of ``raygym/`` (``--doctest-modules``, see pyproject.toml) run in
the CPU suite; modules that only import inside vLLM's own interpreter are left out where vLLM is absent, and the
Modal launcher where modal is not installed."""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("vllm") is None:  # these run inside vLLM's processes (scripts/install_vllm_cpu.sh)
    collect_ignore += ["raygym/engines/vllm/weights.py"]
if importlib.util.find_spec("modal") is None:  # the Modal launcher imports modal (raygym[modal])
    collect_ignore += ["raygym/launchers/modal_app.py"]
