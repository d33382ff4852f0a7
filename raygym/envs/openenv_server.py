"""Serves one OpenEnv environment on this machine: ``python -m raygym.envs.openenv_server TARGET --port P``.

``TARGET`` is ``module:attr``: the environment's FastAPI app (what OpenEnv's ``create_app`` returns; served as it
is) or an OpenEnv ``Environment`` class or factory, which is served with OpenEnv's own ``create_fastapi_app``, the
action and observation classes read from its ``step`` annotations (or its ``Environment[Action, Observation,
State]`` parameters) and ``--sessions`` concurrent sessions. Uvicorn listens on 127.0.0.1 only. The process
ends when the process that started it is gone (a killed rollout manager leaves no server behind).

:func:`resolve_target` is the same lookup without serving: the driver's check before Ray starts.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import threading
import time
import typing
from dataclasses import dataclass
from typing import Any

from raygym.errors import ConfigError

_INSTALL = "pip install 'raygym[openenv]'"


@dataclass
class Target:
    """What ``module:attr`` names: an ``app`` to serve as it is, or an environment ``factory`` with its action
    and observation classes (``concurrent``: its ``SUPPORTS_CONCURRENT_SESSIONS``)."""

    app: Any = None
    factory: Any = None
    action_cls: Any = None
    observation_cls: Any = None
    concurrent: bool = False


def _openenv_server() -> Any:
    try:
        from openenv.core import env_server
    except ImportError:
        raise ConfigError(f"OpenEnv environments need the OpenEnv package (openenv-core): {_INSTALL}") from None
    return env_server


def _io_classes(env_cls: Any, base: Any) -> tuple[Any, Any]:
    """The action and observation classes of an OpenEnv ``Environment`` subclass (None where unknown)."""
    action = observation = None
    try:
        hints = typing.get_type_hints(env_cls.step)
        action, observation = hints.get("action"), hints.get("return")
    except Exception:  # annotations that do not resolve: fall back to the generic parameters
        pass
    for klass in env_cls.__mro__:
        for generic in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(generic) is base and len(typing.get_args(generic)) >= 2:
                args = typing.get_args(generic)
                action = action if isinstance(action, type) else args[0]
                observation = observation if isinstance(observation, type) else args[1]
    ok = [isinstance(c, type) for c in (action, observation)]
    return (action if ok[0] else None), (observation if ok[1] else None)


def resolve_target(module_name: str, attr: str | None, field_name: str = "rollout_env") -> Target:
    """Import ``module_name`` and classify ``attr`` (default ``app``); ConfigError naming ``field_name`` when it is
    neither an app nor an OpenEnv environment whose action and observation classes can be read."""
    env_server = _openenv_server()
    name = attr or "app"
    where = f"{field_name}='openenv:{module_name}:{name}'"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import {module_name!r} ({exc}); put the environment's package on the "
                          "path (raygym train runs from the working directory)") from None
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{where}: module {module_name!r} has no {name!r}; name the server's app "
                              "(create_app(...)) or the Environment class")
    base = env_server.Environment
    if inspect.isclass(obj) and issubclass(obj, base):
        action, observation = _io_classes(obj, base)
        if action is None or observation is None:
            raise ConfigError(f"{where}: cannot tell {obj.__name__}'s action and observation classes; annotate "
                              "step(self, action: MyAction) -> MyObservation, or name the app built by create_app")
        env_cls: Any = obj
        return Target(factory=obj, action_cls=action, observation_cls=observation,
                      concurrent=bool(env_cls.SUPPORTS_CONCURRENT_SESSIONS))
    if callable(obj) and hasattr(obj, "router"):  # a FastAPI / Starlette application
        return Target(app=obj)
    raise ConfigError(f"{where}: a {type(obj).__name__}, neither an OpenEnv server app nor an OpenEnv Environment "
                      "class")


def build_app(target: Target, sessions: int) -> Any:
    """The ASGI app to serve: the target's own app, or OpenEnv's ``create_fastapi_app`` around its environment."""
    if target.app is not None:
        return target.app
    from openenv.core.env_server import create_fastapi_app

    return create_fastapi_app(target.factory, target.action_cls, target.observation_cls,
                              max_concurrent_envs=sessions if target.concurrent else 1)


def _exit_with_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m raygym.envs.openenv_server")
    parser.add_argument("target", help="module:attr (an app, or an OpenEnv Environment class)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--parent", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, args=(args.parent,), daemon=True).start()
    sys.path.insert(0, os.getcwd())
    module_name, _, attr = args.target.partition(":")
    app = build_app(resolve_target(module_name, attr or None), args.sessions)
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", ws_max_size=64 * 1024 * 1024)


if __name__ == "__main__":
    main()
