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
local Ray), any Ray cluster (``RAY_ADDRESS``) and Modal (``launchers/modal_app.py``).

The API key comes from ``$RAYGYM_SERVE_API_KEY`` or a key file, never from a command line; only its
SHA-256 digest is sent to the replicas, and neither is ever logged.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from raygym.config import Recipe
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.errors import ConfigError

API_KEY_ENV = "RAYGYM_SERVE_API_KEY"
# Ray Serve's own throughput settings (those its RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, but the proxy's
# single URL), for a Ray this command starts (on an existing cluster, the cluster's own stand): the proxy
# reaches replicas over gRPC instead of Ray actor calls, and a replica handles requests on its main event loop.
# Measured by benchmarks/serve.py (CPU per request of the proxy and the replica: 9.8 ms -> 6.8 ms here).
SERVE_THROUGHPUT_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
APP_NAME = "raygym-openai"
ENGINES = ("auto", "raygym", "sglang", "vllm")
FRONTENDS = ("auto", "direct", "ray-serve")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ServeSettings:
    """How ``raygym serve`` deploys (validated by :meth:`check`; pure, no Ray)."""

    model_dir: str  # local HF directory every replica loads (shared storage on a multi-node cluster)
    model_name: str  # the id clients send as `model`
    engine: str = "auto"  # auto | raygym | sglang | vllm
    num_replicas: int = 1  # used when max_replicas is None
    min_replicas: int | None = None  # autoscaling range (set max_replicas to autoscale)
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # autoscaling target per replica
    max_ongoing_requests: int = 64  # requests a replica takes at once
    gpus_per_replica: int | None = None  # GPUs of each replica's engine (SGLang's TP size); None: 1 if the cluster has GPUs
    cpus_per_replica: float = 1.0
    max_replicas_per_node: int | None = None
    placement_strategy: str = "STRICT_PACK"
    default_max_tokens: int = 256  # chat completions without max_tokens
    engine_settings: dict[str, Any] = field(default_factory=dict)  # recipe fields the engine reads (sglang_*, seed)
    adapter_dir: str | None = None  # a LoRA adapter (PEFT directory) served beside model_dir's weights
    frontend: str = "auto"  # auto | direct (one box, no Ray Serve: raygym.serve.direct) | ray-serve

    def check(self) -> ServeSettings:
        """Raise :class:`ConfigError` naming the bad setting; returns self."""
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.frontend not in FRONTENDS:
            raise ConfigError(f"frontend={self.frontend!r}: use one of {', '.join(FRONTENDS)}")
        if self.frontend == "direct" and (self.num_replicas != 1 or self.max_replicas is not None):
            raise ConfigError(f"frontend='direct' serves one replica (num_replicas={self.num_replicas}, "
                              f"max_replicas={self.max_replicas}); use --frontend ray-serve to scale out")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement_strategy={self.placement_strategy!r}: use one of "
                              f"{', '.join(PLACEMENT_STRATEGIES)}")
        for name in ("num_replicas", "max_ongoing_requests", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1 (--{name.replace('_', '-')})")
        if (self.gpus_per_replica or 0) < 0 or self.cpus_per_replica <= 0:
            raise ConfigError(f"gpus_per_replica={self.gpus_per_replica}, cpus_per_replica={self.cpus_per_replica}: "
                              "GPUs must be >= 0 and CPUs > 0")
        if self.min_replicas is not None and self.max_replicas is None:
            raise ConfigError("min_replicas is set without max_replicas: give --max-replicas to autoscale")
        if self.max_replicas is not None:
            low = 1 if self.min_replicas is None else self.min_replicas
            if low < 0 or self.max_replicas < max(1, low):
                raise ConfigError(f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: need "
                                  "0 <= min_replicas <= max_replicas and max_replicas >= 1")
            if not self.target_ongoing_requests > 0:
                raise ConfigError(f"target_ongoing_requests={self.target_ongoing_requests}: must be > 0")
        if self.max_replicas_per_node is not None and self.max_replicas_per_node < 1:
            raise ConfigError(f"max_replicas_per_node={self.max_replicas_per_node}: must be >= 1")
        return self


def choose_frontend(settings: ServeSettings, *, attached: bool, detach: bool = False) -> str:
    """``direct`` (the one-box server, :mod:`raygym.serve.direct`) or ``ray-serve`` for ``settings``: ``auto`` is
    direct for one fixed replica when no Ray cluster is ``attached`` (``RAY_ADDRESS`` or a Ray already
    initialised here) and nothing is to be left running (``detach``); else Ray Serve.

    >>> one = ServeSettings("m", "m")
    >>> choose_frontend(one, attached=False), choose_frontend(one, attached=True)
    ('direct', 'ray-serve')
    >>> choose_frontend(ServeSettings("m", "m", max_replicas=4), attached=False)
    'ray-serve'
    """
    settings.check()
    if settings.frontend == "direct" and (attached or detach):
        raise ConfigError("frontend='direct' runs on this box without Ray; unset RAY_ADDRESS (and --detach) or use "
                          "--frontend ray-serve to deploy on the cluster")
    if settings.frontend != "auto":
        return settings.frontend
    one_replica = settings.num_replicas == 1 and settings.max_replicas is None
    return "direct" if one_replica and not attached and not detach else "ray-serve"


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


def read_api_key(environ: dict[str, str] | os._Environ[str], key_file: str | None,
                 warn: Callable[[str], None] = print) -> str:
    """The API key: the contents of ``key_file`` when given, else ``$RAYGYM_SERVE_API_KEY``.

    Raises :class:`ConfigError` when neither holds a key (the server never runs without one)."""
    if key_file:
        path = Path(key_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"api_key_file={key_file!r}: no such file; write the key into it (chmod 600)")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            warn(f"warning: {path} is readable by other users; chmod 600 it")
        key = path.read_text().strip()
        if not key:
            raise ConfigError(f"api_key_file={key_file!r}: the file is empty; write the key into it")
        return key
    key = environ.get(API_KEY_ENV, "").strip()
    if not key:
        raise ConfigError(f"no API key: export {API_KEY_ENV}=... or pass --api-key-file PATH "
                          "(the server refuses to run without one; keys never go on the command line)")
    if len(key) < 8:
        raise ConfigError(f"{API_KEY_ENV}: the key is shorter than 8 characters; use a long random one")
    return key


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica is built from (travels to the replicas; holds the key's digest, not the key)."""

    settings: ServeSettings
    api_key_digest: str


def _context_len(model_dir: str) -> int | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


ENGINE_RECIPE_FIELDS = ("seed", "rollout_engine_python", "rollout_num_gpus", "rollout_num_gpus_per_engine", "rollout_max_prompt_len",
                        "rollout_max_response_len", "update_weight_timeout")


def engine_recipe(engine_settings: dict[str, Any]) -> Recipe:
    """The validated :class:`~raygym.config.Recipe` a replica's engine starts from: the run's engine fields
    (``sglang_*`` and :data:`ENGINE_RECIPE_FIELDS`) over the defaults; the training fields are left out.

    >>> engine_recipe({"sglang_max_running_requests": 32, "lr": 1.0}).sglang_max_running_requests
    32
    """
    chosen = {name: value for name, value in engine_settings.items()
              if name in Recipe.model_fields and (name.startswith("sglang_") or name in ENGINE_RECIPE_FIELDS)}
    return Recipe(**chosen)


def adapter_serving(kind: str, settings: ServeSettings) -> tuple[list[str], dict[str, Any]]:
    """(server flags, fields of every request) that make engine kind ``kind`` serve ``settings.adapter_dir``
    beside the base weights: the adapter is loaded at start under :data:`raygym.lora.ADAPTER_NAME`, which every
    request names (``lora_path``). Nothing without an adapter."""
    if not settings.adapter_dir:
        return [], {}
    from raygym.engines.launch.lora import engine_lora_args
    from raygym.lora import ADAPTER_NAME, LoraSpec, model_targets, read_adapter

    spec = LoraSpec.from_config(read_adapter(settings.adapter_dir)[0])
    targets = model_targets(settings.model_dir, spec)
    return engine_lora_args(kind, spec, targets, settings.adapter_dir), {"lora_path": ADAPTER_NAME}


class ReplicaEngine:
    """The front's engine (:class:`raygym.serve.front.Engine`): the replica's EngineActor on the replica's event
    loop, every request carrying ``fields`` (a LoRA adapter's ``lora_path``)."""

    def __init__(self, engine: Any, fields: dict[str, Any]) -> None:
        self.engine, self.fields = engine, fields

    def generate(self, request: GenerateRequest) -> Awaitable[GenerateResponse | list[GenerateResponse]]:
        return self.engine.generate_async(request.model_copy(update=self.fields) if self.fields else request)

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        return self.engine.generate_stream(request.model_copy(update=self.fields) if self.fields else request)


def preflight_engine_here(settings: ServeSettings) -> str:
    """The engine kind a replica will run, checked before Ray starts: SGLang or vLLM importable by the engine
    interpreter, and on a machine without CUDA a model vLLM's CPU attention can run (its head size). Returns
    the kind; ConfigError names the fix."""
    import torch

    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.engines.interpreter import check_engine_python
    from raygym.engines.launch.vllm import check_cpu_head_dim, checkpoint_head_dim

    kind = choose_rollout_engine(settings.engine)
    if kind in ("sglang", "vllm"):
        check_engine_python(kind, settings.engine_settings.get("rollout_engine_python"))
    if kind == "vllm" and not torch.cuda.is_available():
        check_cpu_head_dim(checkpoint_head_dim(settings.model_dir), settings.model_dir, "raygym serve --engine vllm")
    return kind


def start_engine_front(settings: ServeSettings, gpu_ids: list[int]) -> tuple[Any, Any]:
    """Start the engine ``settings`` name on ``gpu_ids`` and build the OpenAI front in front of it; returns
    ``(EngineActor, OpenAIFront)``. Shared by a Serve replica and the one-box server (:mod:`raygym.serve.direct`)."""
    import tempfile

    from transformers import AutoTokenizer

    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.engines.actor import EngineActor
    from raygym.serve.front import OpenAIFront

    kind = choose_rollout_engine(settings.engine)
    gpus = max(1, len(gpu_ids))  # one engine per replica: it may decode on every core the replica has
    recipe = engine_recipe({**settings.engine_settings, "rollout_num_gpus": gpus, "rollout_num_gpus_per_engine": gpus})
    server_args, fields = adapter_serving(kind, settings)
    engine = EngineActor(recipe, engine_index=0, model_path=settings.model_dir, gpu_ids=gpu_ids,
                         host="127.0.0.1", backend=kind, log_dir=tempfile.mkdtemp(prefix="raygym-serve-engine-"),
                         extra_server_args=server_args)
    try:
        engine.start()
        tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    except BaseException:
        engine.close()
        raise
    context = _context_len(settings.model_dir)
    if kind == "vllm":  # vLLM holds KV cache for the run's longest request, not the model's whole context
        from raygym.engines.launch.vllm import max_model_len

        context = min(context or max_model_len(recipe), max_model_len(recipe))
    front = OpenAIFront(tokenizer, ReplicaEngine(engine, fields), settings.model_name,
                        context_len=context, default_max_tokens=settings.default_max_tokens)
    return engine, front


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


@dataclass(frozen=True)
class Endpoint:
    """Where a started deployment answers."""

    url: str  # base URL of the OpenAI API, e.g. http://127.0.0.1:8000/v1
    model_name: str
    settings: dict[str, Any]


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside (main thread only). Installed after Ray started:
    Ray's own SIGTERM handler would end the process without removing the deployment."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
        with _stop_on_signals(stop):  # Ctrl-C, `ray job stop`, `docker stop`: end the deployment cleanly
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


__all__ = ["API_KEY_ENV", "FRONTENDS", "Endpoint", "OpenAIReplica", "ReplicaEngine", "ReplicaSpec", "ServeSettings",
           "build_application", "choose_frontend", "deployment_options", "preflight_engine_here", "read_api_key",
           "run_server", "start_engine_front"]
