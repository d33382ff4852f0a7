"""The engine protocol is written once: outside ``raygym/engine_api/protocol.py`` no module of ``raygym/`` names an
engine endpoint by a string (``"/generate"``, or ``"update_weights_from_distributed"`` handed to a call as a
route) or builds a ``/generate`` body by hand (a dict or ``dict(...)`` with ``sampling_params`` beside
``input_ids`` or ``text``): they use :class:`raygym.engine_api.protocol.Endpoint` and the request models. Read
from the source with ``ast`` (docstrings are prose and are left out)."""

from __future__ import annotations

import ast
from pathlib import Path

from raygym.engine_api.protocol import Endpoint

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "raygym" / "engine_api" / "protocol.py"
PATHS = {e.value for e in Endpoint}
NAMES = {e.name_without_slash for e in Endpoint}
# Calls whose string argument names a field or attribute, not a route.
FIELD_CALLS = {"get", "pop", "setdefault", "getattr", "hasattr", "setattr"}
GENERATE_KEYS = {"input_ids", "text"}
# The same text meaning something else than raygym's engine API, file by file.
OTHER_APIS = {
    "raygym/serve/http.py": {"/health"},  # raygym serve's own (OpenAI side) health route
    "raygym/envs/openenv_env.py": {"/health"},  # OpenEnv servers' health route
}


def docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def call_name(call: ast.Call) -> str:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else ""


def violations(source: str, where: str) -> list[str]:
    """What of ``source`` names an endpoint by a string or builds a ``/generate`` body by hand."""
    tree = ast.parse(source)
    prose = docstring_nodes(tree)
    allowed = OTHER_APIS.get(where, set())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                and node.value in PATHS - allowed):
            found.append(f"{where}:{node.lineno}: endpoint path {node.value!r} (use Endpoint)")
        if isinstance(node, ast.Call) and call_name(node) not in FIELD_CALLS:
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in NAMES:
                    found.append(f"{where}:{arg.lineno}: endpoint {arg.value!r} passed to {call_name(node)}() "
                                 "(use Endpoint)")
            keys = {k.arg for k in node.keywords}
            if call_name(node) == "dict" and "sampling_params" in keys and keys & GENERATE_KEYS:
                found.append(f"{where}:{node.lineno}: a /generate body built with dict() (use GenerateRequest)")
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if "sampling_params" in keys and keys & GENERATE_KEYS:
                found.append(f"{where}:{node.lineno}: a /generate body built as a dict (use GenerateRequest)")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_no_endpoint_literal_or_hand_built_request_outside_the_protocol():
    found = []
    for path in sorted((ROOT / "raygym").rglob("*.py")):
        if path != PROTOCOL:
            found += violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_check_sees_each_kind_of_violation():
    source = '''
"""A docstring may say /generate and "flush_cache"."""
def push(link, engine, url):
    link.call("update_weights_from_distributed", {}, 10)
    engine.call(method="pause_generation")
    post(url + "/generate")
    post(f"{url}/flush_cache")
    body = {"input_ids": [1, 2], "sampling_params": {}, "return_logprob": True}
    text_body = dict(text="hi", sampling_params={})
    meta.get("weight_version")  # a field, read by name
'''
    found = violations(source, "raygym/example.py")
    assert [line.split(": ", 1)[0] for line in found] == [
        "raygym/example.py:4", "raygym/example.py:5", "raygym/example.py:6", "raygym/example.py:7",
        "raygym/example.py:8", "raygym/example.py:9"], found
    assert violations('post("/health")', "raygym/serve/http.py") == []
    assert violations('post("/health")', "raygym/engines/actor.py") != []
