"""The throughput benchmarks, shipped in the package: ``raygym bench NAME`` runs ``python -m raygym.bench.NAME``.

Each benchmark prints one JSON object per line: the figure, its baseline measured in the same run, their ratio,
and the machine. ``raygym bench --list`` names them; ``docs/benchmarks.md`` is the table of record
(``raygym bench record`` regenerates it from ``docs/bench-records.jsonl``).

The catalog below reads the modules' files, never imports them: a benchmark imports torch, the listing must not.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

# Modules of this package that are not benchmarks: parts the benchmarks share or run elsewhere, and the tools.
NOT_BENCHMARKS = frozenset({
    "charts",  # the report's charts (pure)
    "common",  # helpers several benchmarks use
    "record",  # ``raygym bench record``: the table of record in docs/benchmarks.md
    "rollout_engines", "rollout_timing",  # parts of ``rollout``
    "shaped_link", "weight_sync_receivers", "weight_sync_serving", "weight_sync_trainer",  # parts of ``weight_sync``
    "trl_baseline",  # the TRL side of ``e2e``, run in TRL's interpreter
})
FOLDER = Path(__file__).resolve().parent


def benchmark_names() -> list[str]:
    """The benchmarks, sorted: every module of this package but :data:`NOT_BENCHMARKS`."""
    return sorted(m.name for m in pkgutil.iter_modules([str(FOLDER)]) if m.name not in NOT_BENCHMARKS)


def summary(name: str, width: int = 100) -> str:
    """One line on benchmark ``name``: the first sentence of its docstring (read from its file), cut at a word
    before ``width`` characters.

    >>> summary("e2e")
    "End-to-end step time: per-phase split, sync vs async, and TRL's GRPOTrainer, per model size."
    """
    doc = ast.get_docstring(ast.parse((FOLDER / f"{name}.py").read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "")
    sentence = text.split(". ")[0].rstrip(".") + "."
    return sentence if len(sentence) <= width else sentence[: width - 3].rsplit(" ", 1)[0] + " ..."
