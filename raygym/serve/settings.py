"""``raygym serve``'s settings, checked before anything starts (pure: no Ray, no engine): what to serve and
how (:class:`ServeSettings`), which front runs it (:func:`choose_frontend`: the one-box server of
:mod:`raygym.serve.direct`, or Ray Serve, :mod:`raygym.serve.deployment`), the API key (:func:`read_api_key`:
``$RAYGYM_SERVE_API_KEY`` or a key file, never a command line) and where a started server answers
(:class:`Endpoint`)."""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raygym.errors import ConfigError

API_KEY_ENV = "RAYGYM_SERVE_API_KEY"
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
class Endpoint:
    """Where a started deployment answers."""

    url: str  # base URL of the OpenAI API, e.g. http://127.0.0.1:8000/v1
    model_name: str
    settings: dict[str, Any]


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside (main thread only). Under Ray Serve it is installed after
    Ray started: Ray's own SIGTERM handler would end the process without removing the deployment."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = ["API_KEY_ENV", "ENGINES", "FRONTENDS", "PLACEMENT_STRATEGIES", "Endpoint", "ServeSettings", "choose_frontend",
           "read_api_key", "stop_on_signals"]
