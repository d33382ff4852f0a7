"""``raygym serve``: an OpenAI-compatible endpoint as a Ray Serve application (or, for one replica on one box,
without Ray: :mod:`raygym.serve.direct`, chosen by :func:`choose_frontend`).

Each Serve replica owns one inference engine (:class:`raygym.engines.actor.EngineActor`: raygym's own
server on CPU, SGLang on GPU, chosen like a run's ``rollout_engine``, or vLLM behind raygym's adapter with
``engine="vllm"``, run by ``engine_python``) on the GPUs Ray gives the replica, and answers the OpenAI
routes of :mod:`raygym.serve.http` in front of it, on the replica's own event loop: requests and streams
go to the engine without a thread hop (:meth:`~raygym.engines.actor.EngineActor.generate_async`,
:meth:`~raygym.engines.actor.EngineActor.generate_stream`). Scaling is Ray Serve's:
a fixed ``num_replicas`` or an autoscaling range (``min_replicas`` .. ``max_replicas`` driven by
``target_ongoing_requests``); placement: each replica's CPUs and GPUs are reserved together in one
placement-group bundle (``STRICT_PACK``: an engine's GPUs are on the replica's node), and
``max_replicas_per_node`` spreads replicas over nodes. The same command deploys on a laptop (a private
local Ray), any Ray cluster (``RAY_ADDRESS``) and Modal (``raygym/launchers/modal_app.py``).

The API key comes from ``$RAYGYM_SERVE_API_KEY`` or a key file, never from a command line; only its
SHA-256 digest is sent to the replicas, and neither is ever logged.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from raygym.errors import ConfigError
from raygym.serve.replica_engine import (
    ENGINE_RECIPE_FIELDS,
    ReplicaEngine,
    adapter_serving,
    engine_recipe,
    preflight_engine_here,
    start_engine_front,
)
from raygym.serve.settings import (
    API_KEY_ENV,
    ENGINES,
    FRONTENDS,
    PLACEMENT_STRATEGIES,
    Endpoint,
    ServeSettings,
    choose_frontend,
    read_api_key,
    stop_on_signals,
)

# Ray Serve's own throughput settings (those its RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, but the proxy's
# single URL), for a Ray this command starts (on an existing cluster, the cluster's own stand): the proxy
# reaches replicas over gRPC instead of Ray actor calls, and a replica handles requests on its main event loop.
# Measured by raygym/bench/serve.py (CPU per request of the proxy and the replica: 9.8 ms -> 6.8 ms here).
SERVE_THROUGHPUT_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
APP_NAME = "raygym-openai"
def deployment_options(settings: ServeSettings) -> dict[str, Any]:
    """Ray Serve ``Deployment.options(...)`` for ``settings``: replicas or autoscaling, resources, placement.

    >>> opts = deployment_options(ServeSettings("m", "m", gpus_per_replica=2, max_replicas=4))
    >>> opts["autoscaling_config"]["max_replicas"], opts["placement_group_bundles"]
    (4, [{'CPU': 1.0, 'GPU': 2.0}])
    """
    settings.check()
    gpus = settings.gpus_per_replica or 0
    options: dict[str, Any] = {
        "name": "OpenAIReplica",
        "max_ongoing_requests": settings.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": settings.cpus_per_replica, "num_gpus": gpus},
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 60.0,
        "graceful_shutdown_timeout_s": 30.0,
    }
    if settings.max_replicas is not None:
        low = 1 if settings.min_replicas is None else settings.min_replicas
        options["autoscaling_config"] = {
            "min_replicas": low, "initial_replicas": max(low, 1), "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = settings.num_replicas
    if gpus > 0:  # the engine's GPUs reserved with the replica, on one node
        options["placement_group_bundles"] = [{"CPU": float(settings.cpus_per_replica), "GPU": float(gpus)}]
        options["placement_group_strategy"] = settings.placement_strategy
    if settings.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = settings.max_replicas_per_node
    return options


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica is built from (travels to the replicas; holds the key's digest, not the key)."""

    settings: ServeSettings
    api_key_digest: str


class OpenAIReplica:
    """One Serve replica: starts its engine, then serves the OpenAI routes in front of it."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import ray

        self.spec = spec
        gpus = spec.settings.gpus_per_replica or 0
        gpu_ids = [int(g) for g in ray.get_gpu_ids()] if gpus > 0 else []
        self.engine, self.front = start_engine_front(spec.settings, gpu_ids)

    def __serve_build_asgi_app__(self) -> Any:
        from raygym.serve.http import build_http_app

        return build_http_app(self.front, self.spec.api_key_digest)

    def check_health(self) -> None:
        """Serve's health probe: a dead engine makes the replica unhealthy (Serve replaces it)."""
        if not self.engine.alive():
            raise RuntimeError("the replica's engine server exited; see its log:\n" + self.engine.log_tail(20))

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def build_application(spec: ReplicaSpec) -> Any:
    """The bound Serve application for ``spec`` (pass it to ``serve.run``)."""
    from ray import serve

    deployment: Any = serve.deployment(serve.ingress()(OpenAIReplica))
    return deployment.options(**deployment_options(spec.settings)).bind(spec)


def run_server(settings: ServeSettings, api_key: str, *, host: str = "127.0.0.1", port: int = 8000,
               route_prefix: str = "/", detach: bool = False, say: Callable[[str], None] = print,
               stop: threading.Event | None = None, on_ready: Callable[[Endpoint], None] | None = None) -> Endpoint:
    """Deploy and (unless ``detach``) serve until ``stop`` is set or Ctrl-C; then end what was started.

    One fixed replica and no Ray cluster (``settings.frontend='auto'``): the one-box server, no Ray at all
    (:func:`raygym.serve.direct.run_direct`). Otherwise Ray Serve: attaches to the Ray of this process or
    ``RAY_ADDRESS``, else starts a local Ray (shut down at the end). ``detach`` (only on an existing cluster)
    leaves the application running there and returns at once.
    """
    import ray
    from ray import serve

    from raygym.run.driver import connect_ray
    from raygym.serve.http import key_digest

    settings.check()
    if not route_prefix.startswith("/"):
        raise ConfigError(f"route_prefix={route_prefix!r}: must start with '/'")
    attached = ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))
    frontend = choose_frontend(settings, attached=attached, detach=detach)
    preflight_engine_here(settings)  # the engine can run the model here, before Ray starts
    if frontend == "direct":
        from raygym.serve.direct import run_direct

        return run_direct(settings, api_key, host=host, port=port, route_prefix=route_prefix, say=say, stop=stop,
                          on_ready=on_ready)
    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):  # the processes of the Ray started here
        for name, value in SERVE_THROUGHPUT_ENV.items():
            os.environ.setdefault(name, value)
    owns_ray = connect_ray(0)
    if detach and owns_ray:
        ray.shutdown()
        raise ConfigError("--detach needs an existing Ray cluster (set RAY_ADDRESS); a private local Ray ends "
                          "with this process")
    if settings.gpus_per_replica is None:
        settings = replace(settings, gpus_per_replica=int(ray.cluster_resources().get("GPU", 0) > 0))
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        serve.run(build_application(ReplicaSpec(settings, key_digest(api_key))), name=APP_NAME,
                  route_prefix=route_prefix, blocking=False)
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}{route_prefix.rstrip('/')}/v1"
        endpoint = Endpoint(base, settings.model_name, asdict(settings))
        say(f"serving {settings.model_name} at {base} (OpenAI API; Ctrl-C stops)"
            if not detach else f"deployed {settings.model_name} at {base} (application {APP_NAME!r})")
        if on_ready is not None:
            on_ready(endpoint)
        if detach:
            return endpoint
        stop = stop or threading.Event()
        with stop_on_signals(stop):  # Ctrl-C, `ray job stop`, `docker stop`: end the deployment cleanly
            stop.wait()
        say("stopping: removing the deployment")
        return endpoint
    finally:
        if not detach:
            try:
                if owns_ray:
                    serve.shutdown()  # replicas end their engines (graceful shutdown runs their __del__)
                else:
                    serve.delete(APP_NAME)
            finally:
                if owns_ray:
                    ray.shutdown()


__all__ = ["API_KEY_ENV", "ENGINES", "ENGINE_RECIPE_FIELDS", "FRONTENDS", "PLACEMENT_STRATEGIES", "Endpoint",
           "OpenAIReplica", "ReplicaEngine", "ReplicaSpec", "ServeSettings", "adapter_serving", "build_application",
           "choose_frontend", "deployment_options", "engine_recipe", "preflight_engine_here", "read_api_key",
           "run_server", "start_engine_front"]
