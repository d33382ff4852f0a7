"""raygym's modules import each other without a circle, and its layers in one direction.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` anywhere in a file counts
(under ``if TYPE_CHECKING:``, inside functions), a name resolves to the deepest module it names, and importing a
package's ``__init__`` (a re-export) is no edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files(package: str = "raygym", root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` under ``root/package`` (a package is its ``__init__``)."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (root / package).rglob("*.py")}


def imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement may load (``from a import b``: ``a`` and ``a.b``), relative
    imports resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` it imports (never itself, never a package ``__init__``)."""
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in imported_names(node, package):
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module and files[name].name != "__init__.py":
                    graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def reachable(graph: dict[str, set[str]], starts: Iterable[str]) -> set[str]:
    """Every module ``starts`` import, directly or through others."""
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        for succ in graph[todo.pop()] - seen:
            seen.add(succ)
            todo.append(succ)
    return seen


GRAPH = import_graph(module_files())


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n    return c\nB = 2\n")
    (pkg / "c.py").write_text("import pkg.a.A\nfrom pkg import a\n")
    graph = import_graph(module_files("pkg", tmp_path))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert circles({"x": {"y"}, "y": set()}) == []


def test_raygym_has_no_import_circle():
    assert len(GRAPH) > 100 and GRAPH["raygym.config.run"]  # the whole package, read
    assert circles(GRAPH) == []


CONFIG = [m for m in GRAPH if m.startswith("raygym.config.")]


def test_the_config_layer_imports_neither_rollout_nor_weightsync():
    above = {m for m in reachable(GRAPH, CONFIG) if m.startswith(("raygym.rollout", "raygym.weightsync"))}
    assert above == set(), "raygym.config reaches " + ", ".join(sorted(above))


def test_presets_are_applied_by_the_loader_only():
    classes = [m for m in CONFIG if m != "raygym.config.loader"]
    assert {"raygym.presets", "raygym.config.loader"} & reachable(GRAPH, classes) == set()
    assert "raygym.presets" in GRAPH["raygym.config.loader"]


def test_rollout_imports_weightsync_never_the_reverse():
    weightsync = [m for m in GRAPH if m.startswith("raygym.weightsync")]
    back = {m for m in reachable(GRAPH, weightsync) if m.startswith("raygym.rollout")}
    assert back == set(), "raygym.weightsync reaches " + ", ".join(sorted(back))
