"""raygym's modules and packages import each other without a circle, and the design's parts in one direction.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` anywhere in a file counts
(under ``if TYPE_CHECKING:``, inside functions). ``from pkg import mod`` is an edge to the module ``pkg.mod``;
``from pkg import Name`` is an edge to ``pkg``'s ``__init__``, which is a node like any module, so a re-export is
followed to the module that defines the name. Reading a package's metadata (``from raygym import __version__``)
is no edge. The package of ``raygym.a.b.c`` is ``raygym.a``; a loose module (``raygym.errors``) is its own.

The package rules are the design's (``Layout`` in the design notes): the engine API below everything that talks to
an engine, the allocator below engines, trainers and rollout, configuration free of torch and ray.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_files(package: str = "raygym", root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file, for every ``.py`` under ``root/package`` (a package is its ``__init__``)."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (root / package).rglob("*.py")}


def imported_modules(node: ast.AST, package: str, files: dict[str, Path]) -> list[str]:
    """The modules of ``files`` an import statement loads, relative imports resolved against ``package``."""
    def deepest(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    if isinstance(node, ast.Import):
        return [deepest(alias.name) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    found = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in files:
            found.append(full)  # a submodule: the package's __init__ re-exports nothing here
        elif not (alias.name.startswith("__") and alias.name.endswith("__")):
            found.append(deepest(base))
    return found


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module (a package's ``__init__`` included) -> the modules of ``files`` it imports (never itself)."""
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            graph[module].update(name for name in imported_modules(node, package, files) if name and name != module)
    return graph


def package_of(module: str) -> str:
    """``raygym.engines.vllm.server`` -> ``raygym.engines``; a loose module and the root are their own package."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, imports in graph.items():
        mine = package_of(module)
        packages.setdefault(mine, set()).update(package_of(m) for m in imports if package_of(m) != mine)
    return packages


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
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
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
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


def imports_anywhere(path: Path, package: str) -> bool:
    """Whether the file imports ``package`` (or a module of it) anywhere: module level, functions, TYPE_CHECKING."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == package:
            return True
    return False


def loads_at_import(path: Path, packages: tuple[str, ...]) -> bool:
    """Whether importing the file imports one of ``packages`` (module level or a class body; not inside a
    function, not under ``if TYPE_CHECKING:``)."""
    def walk(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                if walk(node.orelse):
                    return True
                continue
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in packages for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in packages:
                return True
            nested = [*getattr(node, "body", []), *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                      *(s for h in getattr(node, "handlers", []) for s in h.body)]
            if walk([n for n in nested if isinstance(n, ast.stmt)]):
                return True
        return False

    return walk(ast.parse(path.read_text(), str(path)).body)


FILES = module_files()
GRAPH = import_graph(FILES)
PACKAGES = package_graph(GRAPH)


def inside(package: str) -> list[str]:
    return [m for m in GRAPH if package_of(m) == package]


def reached_packages(package: str) -> set[str]:
    return {package_of(m) for m in reachable(GRAPH, inside(package))} - {package}


def test_the_graph_reader_sees_every_kind_of_import_and_follows_re_exports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n__version__ = '1'\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n    return c\nB = 2\n")
    (pkg / "c.py").write_text("import pkg.a.A\nfrom pkg import __version__\n")
    (pkg / "d.py").write_text("from pkg import A\n")  # through the __init__'s re-export
    files = module_files("pkg", tmp_path)
    graph = import_graph(files)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg"}}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert reachable(graph, ["pkg.d"]) == {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert circles({"x": {"y"}, "y": set()}) == []
    assert package_graph({"r.p.x": {"r.q.y"}, "r.q.y": {"r.p.z"}, "r.p.z": set()}) == {"r.p": {"r.q"}, "r.q": {"r.p"}}
    (pkg / "e.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import torch\ndef f():\n    import ray\n")
    (pkg / "f.py").write_text("try:\n    import torch\nexcept ImportError:\n    torch = None\n")
    assert not loads_at_import(pkg / "e.py", ("torch", "ray")) and loads_at_import(pkg / "f.py", ("torch", "ray"))


def test_raygym_has_no_module_circle():
    assert len(GRAPH) > 150 and GRAPH["raygym.config.run"]  # the whole package, read
    assert circles(GRAPH) == []


def test_raygym_has_no_package_circle():
    assert {"raygym.engines", "raygym.cluster", "raygym.run", "raygym.engine_api"} <= set(PACKAGES)
    assert circles(PACKAGES) == []


def test_the_design_parts_are_packages_and_few_modules_are_loose():
    loose = sorted(m for m, p in FILES.items() if m.count(".") == 1 and p.name != "__init__.py")
    assert len(loose) <= 10, loose
    for part in ("cluster", "trainer", "engines", "engine_api", "weightsync", "rollout", "run", "config"):
        assert (ROOT / "raygym" / part / "__init__.py").is_file(), part


def test_the_engine_api_imports_only_errors():
    assert reached_packages("raygym.engine_api") <= {"raygym.errors"}


def test_the_config_layer_loads_neither_torch_nor_ray():
    reached = reachable(GRAPH, inside("raygym.config")) | set(inside("raygym.config"))
    heavy = sorted(m for m in reached if loads_at_import(FILES[m], ("torch", "ray")))
    assert heavy == [], "importing raygym.config loads torch or ray through " + ", ".join(heavy)
    assert not reached_packages("raygym.config") & {"raygym.rollout", "raygym.weightsync", "raygym.engines",
                                                   "raygym.trainer", "raygym.run", "raygym.cluster"}


def test_presets_are_applied_by_the_config_loading_of_a_run_only():
    assert "raygym.presets" not in reachable(GRAPH, inside("raygym.config"))
    assert "raygym.presets" in GRAPH["raygym.run.config_loading"]


@pytest.mark.parametrize(("package", "never"), [
    ("raygym.cluster", {"raygym.engines", "raygym.trainer", "raygym.rollout", "raygym.weightsync", "raygym.run"}),
    ("raygym.rollout", {"raygym.trainer", "raygym.run"}),
    ("raygym.weightsync", {"raygym.engines", "raygym.rollout", "raygym.run"}),
    ("raygym.trainer", {"raygym.engines", "raygym.rollout", "raygym.run"}),
    ("raygym.engines", {"raygym.trainer", "raygym.rollout", "raygym.run"}),
    ("raygym.algo", {"raygym.trainer", "raygym.cluster", "raygym.engines", "raygym.rollout", "raygym.run"}),
    ("raygym.checkpoint", {"raygym.trainer", "raygym.engines", "raygym.rollout", "raygym.run"}),
])
def test_a_part_never_reaches_the_parts_above_it(package, never):
    above = reached_packages(package) & never
    culprits = sorted(m for m in inside(package) if {package_of(n) for n in reachable(GRAPH, [m])} & above)
    assert above == set(), f"{package} reaches {sorted(above)} from " + ", ".join(culprits[:10])


MODAL_LAUNCHER = {m for m in FILES if m.startswith("raygym.launchers.modal_")}  # raygym/launchers/modal_*.py


def test_only_the_modal_launcher_imports_modal():
    importers = sorted(m for m, path in FILES.items() if imports_anywhere(path, "modal"))
    assert "raygym.launchers.modal_app" in importers  # the reader sees the launcher's own import
    assert set(importers) <= MODAL_LAUNCHER, f"only raygym/launchers/modal_*.py may import modal: {importers}"


def test_nothing_outside_the_modal_launcher_imports_it():
    reaching = sorted(m for m in GRAPH if m not in MODAL_LAUNCHER and reachable(GRAPH, [m]) & MODAL_LAUNCHER)
    assert reaching == [], "these reach raygym/launchers/modal_*.py (and so modal): " + ", ".join(reaching)


def test_the_launchers_sit_above_the_library():
    """Launchers submit runs; only the CLI (raygym submit) and the benchmarks use them, never the library's parts."""
    users = sorted({package_of(m) for m, imports in GRAPH.items()
                    if any(package_of(n) == "raygym.launchers" for n in imports)} - {"raygym.launchers"})
    assert "raygym.cli" in users
    assert set(users) <= {"raygym.cli", "raygym.bench"}, users
