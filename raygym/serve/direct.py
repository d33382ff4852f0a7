"""``raygym serve`` on one box: the OpenAI front and its engine without Ray Serve.

One engine, one replica, nothing to autoscale: Ray Serve's HTTP proxy and the hop from it to a replica are
pure cost there (``raygym/bench/serve.py``: Ray Serve answers ~0.3 of the engine's own request rate on 2 cores,
this server ~0.8). It runs the same ASGI app (:func:`raygym.serve.http.build_http_app`: same routes, key
check and errors) under uvicorn in this process, and the same front and engine as a Serve
replica (:func:`raygym.serve.replica_engine.start_engine_front`): a request is one HTTP hop from the client to the
front, and one from the front to the engine's ``/generate``. No Ray is started.

A watchdog restarts the engine when its process dies (what Serve does by replacing the replica); requests
in flight at that moment get an error. ``raygym serve`` takes this path when one fixed replica is asked for
and no Ray cluster is attached (``--frontend auto``); ``--frontend ray-serve`` forces Serve.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from raygym.errors import ConfigError, RaygymError
from raygym.serve.replica_engine import start_engine_front
from raygym.serve.settings import Endpoint, ServeSettings, stop_on_signals

log = logging.getLogger(__name__)
WATCHDOG_PERIOD_S = 2.0


def local_gpu_ids(gpus: int, visible: str | None) -> list[int]:
    """The first ``gpus`` devices of ``CUDA_VISIBLE_DEVICES`` (``visible``; None: all, numbered from 0).

    >>> local_gpu_ids(2, "3,5,6"), local_gpu_ids(1, None), local_gpu_ids(0, "1")
    ([3, 5], [0], [])
    """
    if gpus <= 0:
        return []
    ids = [int(v) for v in visible.split(",") if v.strip()] if visible else list(range(gpus))
    if len(ids) < gpus:
        raise ConfigError(f"gpus_per_replica={gpus}: only {len(ids)} GPU(s) visible here (CUDA_VISIBLE_DEVICES="
                          f"{visible!r}); ask for fewer or serve on a cluster with --frontend ray-serve")
    return ids[:gpus]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; ConfigError when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"port={port}: cannot listen on {host}:{port} ({exc.strerror}); pick another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def mounted(app: Any, route_prefix: str) -> Any:
    """``app`` answering under ``route_prefix`` (``/`` leaves it as it is)."""
    if route_prefix.rstrip("/") == "":
        return app
    from starlette.applications import Starlette
    from starlette.routing import Mount

    return Starlette(routes=[Mount(route_prefix.rstrip("/"), app=app)])


def run_direct(settings: ServeSettings, api_key: str, *, host: str = "127.0.0.1", port: int = 8000,
               route_prefix: str = "/", say: Callable[[str], None] = print, stop: threading.Event | None = None,
               on_ready: Callable[[Endpoint], None] | None = None) -> Endpoint:
    """Start the engine and the front, serve until ``stop`` is set or Ctrl-C, then end the engine.

    ``settings`` must ask for one fixed replica (:func:`raygym.serve.settings.choose_frontend`)."""
    import torch
    import uvicorn

    from raygym.serve.http import build_http_app, key_digest

    settings.check()
    if settings.max_replicas is not None or settings.num_replicas != 1:
        raise ConfigError(f"num_replicas={settings.num_replicas}, max_replicas={settings.max_replicas}: the one-box "
                          "server runs one replica; use --frontend ray-serve for more")
    gpus = settings.gpus_per_replica if settings.gpus_per_replica is not None else int(torch.cuda.is_available())
    gpu_ids = local_gpu_ids(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    listener = bind(host, port)  # a port in use fails here, before the engine starts
    try:
        engine, front = start_engine_front(settings, gpu_ids)
    except BaseException:
        listener.close()
        raise
    stop = stop or threading.Event()
    server = uvicorn.Server(uvicorn.Config(mounted(build_http_app(front, key_digest(api_key)), route_prefix),
                                          log_level="warning", access_log=False, proxy_headers=False,
                                          server_header=False, date_header=False, timeout_graceful_shutdown=5))
    # uvicorn runs on a thread of its own, where it installs no signal handlers: Ctrl-C is ours (``stop``)
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            server.run(sockets=[listener])
        except BaseException as exc:
            failed.append(exc)
        finally:
            stop.set()

    def watchdog() -> None:
        while not stop.wait(WATCHDOG_PERIOD_S):
            if not engine.alive():
                log.warning("raygym serve: the engine exited; restarting it. Its log:\n%s", engine.log_tail(20))
                try:
                    engine.restart()
                except Exception as exc:
                    failed.append(RaygymError(f"the engine exited and did not restart: {exc}"))
                    stop.set()

    threads = [threading.Thread(target=serve, name="raygym-serve-http", daemon=True),
               threading.Thread(target=watchdog, name="raygym-serve-watchdog", daemon=True)]
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}{route_prefix.rstrip('/')}/v1"
    endpoint = Endpoint(base, settings.model_name, {**asdict(settings), "frontend": "direct"})
    try:
        with stop_on_signals(stop):  # Ctrl-C, SIGTERM: end the engine cleanly
            for thread in threads:
                thread.start()
            say(f"serving {settings.model_name} at {base} (OpenAI API; one box, no Ray Serve; Ctrl-C stops)")
            if on_ready is not None:
                on_ready(endpoint)
            stop.wait()
        if failed:
            raise failed[0] if isinstance(failed[0], RaygymError) else RaygymError(f"raygym serve: {failed[0]!r}")
        say("stopping: ending the engine")
        return endpoint
    finally:
        stop.set()
        server.should_exit = True
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=30)
        listener.close()
        engine.close()


__all__ = ["local_gpu_ids", "mounted", "run_direct"]
