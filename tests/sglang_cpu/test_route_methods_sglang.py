"""raygym's table of SGLang's HTTP methods (``raygym.engine_api.protocol.SGLANG_ROUTE_METHODS``), derived from
each release the ``sglang`` extra allows: the routes of its ``srt/entrypoints/http_server.py`` (the FastAPI
decorators ``@app.get/post/put/delete`` and ``@app.api_route(..., methods=[...])``), read with ``ast`` from the
package scripts/install_sglang_cpu.sh downloads (``args/<version>``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from raygym.engine_api.protocol import SGLANG_ROUTE_METHODS, Endpoint
from raygym.engines.launch.sglang import SUPPORTED_SGLANG

pytestmark = pytest.mark.sglang_cpu


def sglang_routes(http_server: Path) -> dict[str, set[str]]:
    """path -> methods of every route a FastAPI decorator on ``app`` declares in ``http_server``."""
    table: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(http_server.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"
                    and deco.args and isinstance(deco.args[0], ast.Constant)):
                continue
            kind, path = deco.func.attr, deco.args[0].value
            if kind in ("get", "post", "put", "delete"):
                methods = {kind.upper()}
            elif kind == "api_route":
                given = [kw.value for kw in deco.keywords if kw.arg == "methods"]
                assert given and isinstance(given[0], ast.List), f"{http_server}: {path} without methods"
                methods = {e.value for e in given[0].elts if isinstance(e, ast.Constant)}
            else:
                continue
            table.setdefault(path, set()).update(methods)
    return table


@pytest.fixture(scope="module")
def tables() -> dict[str, dict[str, set[str]]]:
    from tests.sglang_cpu.conftest import sglang_home

    out = {}
    for version in SUPPORTED_SGLANG:
        source = sglang_home() / "args" / version / "sglang" / "srt" / "entrypoints" / "http_server.py"
        if not source.is_file():
            pytest.fail(f"{source} is missing: scripts/install_sglang_cpu.sh downloads every release")
        out[version] = sglang_routes(source)
        assert len(out[version]) > 40, f"SGLang {version}: only {len(out[version])} routes parsed"
    return out


@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_raygym_takes_every_method_this_release_takes(tables, version):
    for endpoint, methods in SGLANG_ROUTE_METHODS.items():
        theirs = tables[version].get(endpoint.value)
        if theirs is not None:
            assert theirs <= methods, f"SGLang {version} serves {endpoint.value} on {sorted(theirs)}"


def test_the_table_is_the_union_over_the_releases_and_nothing_more(tables):
    for endpoint, methods in SGLANG_ROUTE_METHODS.items():
        union = set().union(*(t.get(endpoint.value, set()) for t in tables.values()))
        assert union, f"{endpoint.value} is a route of no SGLang release the extra allows"
        assert union == methods, (endpoint.value, sorted(union), sorted(methods))


def test_every_sglang_route_raygym_speaks_is_in_the_table(tables):
    every = set().union(*tables.values())
    for endpoint in Endpoint:
        if endpoint.value in every:
            assert endpoint in SGLANG_ROUTE_METHODS, f"{endpoint.value} is SGLang's; give it SGLang's methods"
