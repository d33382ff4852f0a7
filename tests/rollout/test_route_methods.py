"""raygym's servers take exactly stock SGLang's HTTP methods, route by route (raygym's server and the vLLM
adapter): a client written for SGLang (its own tests and benchmarks, slime, verl flush with GET) works
unchanged, and a method SGLang refuses is a 405 here too. The table itself is checked against each SGLang
release's ``http_server.py`` in tests/sglang_cpu/test_route_methods_sglang.py."""

from __future__ import annotations

import pytest
from aiohttp import web

from raygym.builtin import build_tiny_model
from raygym.engine_api.protocol import RAYGYM_ROUTE_METHODS, SGLANG_ROUTE_METHODS, Endpoint, route_methods
from raygym.engines.raygym_server.generation import GenerationEngine
from raygym.engines.raygym_server.server import InferenceServer
from raygym.engines.vllm.server import VllmAdapter

# Endpoints raygym's clients send to SGLang but neither of raygym's servers serves.
CLIENT_ONLY = {Endpoint.WEIGHTS_CHECKER}


def served(app: web.Application) -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    for route in app.router.routes():
        table.setdefault(route.resource.canonical, set()).add(route.method)
    return table


def raygym_app() -> web.Application:
    model, _ = build_tiny_model(seed=0)
    engine = GenerationEngine(model, eos_token_ids=[1])
    return InferenceServer(engine, model_path="builtin:tiny-qwen3").app()


def vllm_app() -> web.Application:
    adapter = VllmAdapter(None, model_path="m", vocab_size=8, eos_token_id=None, weight_version="0", device="cpu",
                          sleep_mode=False, timeout_s=1.0)
    return adapter.app()


@pytest.mark.parametrize("make_app", [raygym_app, vllm_app], ids=["raygym", "vllm-adapter"])
def test_every_route_takes_exactly_the_methods_of_its_table(make_app):
    table = served(make_app())
    assert table, "no routes"
    for path, methods in table.items():
        endpoint = Endpoint(path)
        assert methods == set(route_methods(endpoint)), (path, sorted(methods))
    sglang_routes = {e.value for e in SGLANG_ROUTE_METHODS} - {e.value for e in CLIENT_ONLY}
    missing = sglang_routes - set(table)
    # The weight routes raygym's server has are the adapter's too, but the adapter has no /get_weights_by_name.
    assert missing <= {Endpoint.GET_WEIGHTS_BY_NAME.value}, missing
    assert set(table) <= sglang_routes | {e.value for e in RAYGYM_ROUTE_METHODS}


def test_flush_cache_and_memory_routes_take_get_as_sglang_does():
    assert route_methods(Endpoint.FLUSH_CACHE) == {"GET", "POST"}
    assert route_methods(Endpoint.RELEASE_MEMORY) == {"GET", "POST"}
    assert route_methods(Endpoint.GENERATE) == {"POST", "PUT"}
    assert route_methods(Endpoint.PAUSE_GENERATION) == {"POST"}
    assert route_methods(Endpoint.HEALTH) == {"GET"}
