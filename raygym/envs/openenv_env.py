"""OpenEnv environments in raygym, unchanged: ``--rollout-env openenv:<module>[:<attr>][?options]``.

raygym starts the environment's server on this machine (``python -m raygym.envs.openenv_server``, one or more
processes beside the rollout manager, 127.0.0.1 only, ended with it) and plays every episode as one session of
OpenEnv's WebSocket protocol (``/ws``: ``reset``, ``step``, ``close``; the session keeps the environment's state
between steps). :class:`OpenEnvEnvironment` is a :class:`raygym.envs.Environment`, so episodes run through
:class:`raygym.envs.EpisodeRunner`: token in / token out, the model's tokens trained (mask 1), observations not.

Per episode: ``reset`` gets ``seed`` (the row's ``metadata["seed"]``, else a number derived from the prompt, so the
samples of a group face the same task), an ``episode_id`` and the entries of ``metadata["openenv_reset"]``; its
observation follows the prompt. Each model turn is sent as the action ``{<action field>: <turn text>}``; the
observation shown next is the ``observation`` field (default: the observation's only text field, else its fields
as ``name: value`` lines); rewards add up to the episode's reward; ``done`` ends the episode.

Options (query of the spec): ``action`` / ``observation`` (field names; the action field defaults to the action
schema's only required text field), ``sessions`` (concurrent sessions per server: default 64 for an environment
class raygym serves that declares ``SUPPORTS_CONCURRENT_SESSIONS``, else 1), ``servers`` (server processes,
default 1), ``stop`` (a string that ends a model turn).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

from raygym.envs.base import Environment, Step
from raygym.envs.openenv_server import Target, resolve_target
from raygym.envs.specs import EnvSpec
from raygym.errors import ConfigError, RaygymError

STARTUP_TIMEOUT_S = 60.0
DEFAULT_CONCURRENT_SESSIONS = 64
_SKIP_FIELDS = ("done", "reward", "metadata")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One OpenEnv server process (its own process group, ended by pid)."""

    def __init__(self, target: str, sessions: int, log_dir: str) -> None:
        self.target, self.sessions = target, sessions
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"openenv-{self.port}.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "raygym.envs.openenv_server", target, "--port", str(self.port),
                 "--sessions", str(sessions), "--parent", str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd())

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll ``/health`` until it answers, while watching that the process lives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RaygymError(f"the OpenEnv server {self.target} exited with code {self.process.returncode} "
                                  f"before it was ready: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RaygymError(f"the OpenEnv server {self.target} did not answer /health within {timeout:g} s: "
                          f"{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                return log.read()[-2000:].decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"

    def schema(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/schema", timeout=10) as answer:
            return dict(json.loads(answer.read()))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _text_fields(schema: dict[str, Any]) -> list[str]:
    props = schema.get("properties") or {}
    return [name for name, prop in props.items()
            if name not in _SKIP_FIELDS and isinstance(prop, dict) and prop.get("type") == "string"]


def action_field(schema: dict[str, Any], chosen: str | None, where: str) -> str:
    """The action field that receives the model's text: ``chosen``, else the schema's only required string field
    (the only string field when none is required)."""
    props = schema.get("properties") or {}
    if chosen is not None:
        if chosen not in props:
            raise ConfigError(f"{where}: the action has no field {chosen!r} (its fields: {', '.join(props)})")
        return chosen
    texts = _text_fields(schema)
    required = [name for name in texts if name in (schema.get("required") or [])]
    candidates = required or texts
    if len(candidates) != 1:
        raise ConfigError(f"{where}: cannot tell which action field gets the model's text (text fields: "
                          f"{', '.join(texts) or 'none'}); add ?action=<field> to the spec")
    return candidates[0]


def observation_text(observation: dict[str, Any], field: str | None) -> str:
    """What the model is shown of an observation: ``field``, else its only text field, else ``name: value`` lines.

    >>> observation_text({"echoed": "hi", "n": 2}, None), observation_text({"a": 1, "b": "x"}, "b")
    ('hi', 'x')
    >>> observation_text({"stdout": "4", "exit_code": 0, "stderr": ""}, None)
    'stdout: 4\\nexit_code: 0\\n'
    """
    if field is not None:
        value = observation.get(field)
        return "" if value is None else str(value)
    shown = {k: v for k, v in observation.items() if k not in _SKIP_FIELDS}
    texts = [k for k, v in shown.items() if isinstance(v, str)]
    if len(texts) == 1 and all(isinstance(v, (int, float, bool)) or v is None or k == texts[0]
                               for k, v in shown.items()):
        return str(shown[texts[0]])
    return "".join(f"{k}: {v}\n" for k, v in shown.items() if v not in ("", None))


def episode_seed(prompt: Any, metadata: dict[str, Any]) -> int:
    """``metadata["seed"]``, else a number derived from the prompt (the samples of a group share it)."""
    if isinstance(metadata.get("seed"), int):
        return int(metadata["seed"])
    digest = hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass
class _Slot:
    server: ServerProcess
    free: asyncio.Semaphore
    in_use: int = 0


class OpenEnvPool:
    """The servers of one ``openenv:`` spec and a session slot per concurrent episode; calling it makes an
    :class:`OpenEnvEnvironment` (it is the runner's environment factory)."""

    def __init__(self, spec: EnvSpec, *, message_timeout: float = 300.0, field_name: str = "rollout_env") -> None:
        target: Target = resolve_target(spec.target, spec.attr, field_name)
        where = f"{field_name}='openenv:{spec.target}'"
        default_sessions = DEFAULT_CONCURRENT_SESSIONS if target.app is None and target.concurrent else 1
        sessions = int(spec.options.get("sessions", default_sessions))
        if target.app is None and not target.concurrent and sessions > 1:
            raise ConfigError(f"{where}: sessions={sessions}, but the environment does not declare "
                              "SUPPORTS_CONCURRENT_SESSIONS; use servers=<n> for episodes in parallel")
        self.sessions = sessions
        self.message_timeout = message_timeout
        self.turn_stop = tuple(str(s) for s in _as_list(spec.options.get("stop")))
        self.log_dir = tempfile.mkdtemp(prefix="raygym-openenv-")
        name = f"{spec.target}:{spec.attr or 'app'}"
        self.servers = [ServerProcess(name, sessions, self.log_dir) for _ in range(int(spec.options.get("servers", 1)))]
        try:
            for server in self.servers:
                server.wait_ready()
            schema = self.servers[0].schema()
        except BaseException:
            self.close()
            raise
        self.action = action_field(schema.get("action") or {}, spec.options.get("action"), where)
        observed = spec.options.get("observation")
        if observed is not None and observed not in ((schema.get("observation") or {}).get("properties") or {}):
            self.close()
            raise ConfigError(f"{where}: the observation has no field {observed!r}")
        self.observation = observed
        self._slots: list[_Slot] | None = None
        self._session: Any = None

    async def acquire(self) -> tuple[Any, _Slot]:
        """An aiohttp session and a server slot (waits while every server is at its session limit)."""
        import aiohttp

        if self._slots is None:
            self._slots = [_Slot(s, asyncio.Semaphore(s.sessions)) for s in self.servers]
            self._session = aiohttp.ClientSession()
        slot = min(self._slots, key=lambda s: s.in_use)  # the least busy server
        slot.in_use += 1
        await slot.free.acquire()
        return self._session, slot

    def __call__(self) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.close()

    def close(self) -> None:
        for server in self.servers:
            server.stop()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class OpenEnvEnvironment(Environment):
    """One episode as one OpenEnv session (see the module docstring)."""

    def __init__(self, pool: OpenEnvPool) -> None:
        self.pool = pool
        self.turn_stop = pool.turn_stop
        self._ws: Any = None
        self._slot: _Slot | None = None
        self.done = False

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        await self._ws.send_str(json.dumps(message))
        reply = await self._ws.receive(timeout=self.pool.message_timeout)
        if reply.type.name != "TEXT":
            raise RaygymError(f"the OpenEnv server closed the session ({reply.type.name}: {reply.data!r})")
        answer = json.loads(reply.data)
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            raise RaygymError(f"the OpenEnv server answered {data.get('code', 'error')}: {data.get('message')}")
        return dict(answer.get("data") or {})

    async def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> str | None:
        session, self._slot = await self.pool.acquire()
        self._ws = await session.ws_connect(self._slot.server.url + "/ws", max_msg_size=64 * 1024 * 1024)
        data = {"seed": episode_seed(prompt, metadata), "episode_id": uuid.uuid4().hex,
                **dict(metadata.get("openenv_reset") or {})}
        answer = await self._send({"type": "reset", "data": data})
        self.done = bool(answer.get("done"))
        return observation_text(answer.get("observation") or {}, self.pool.observation) or None

    async def step(self, action: str) -> Step:
        if self.done:
            return Step(done=True)
        answer = await self._send({"type": "step", "data": {self.pool.action: action}})
        self.done = bool(answer.get("done"))
        return Step(observation=observation_text(answer.get("observation") or {}, self.pool.observation),
                    reward=float(answer.get("reward") or 0.0), done=self.done)

    async def aclose(self) -> None:
        try:
            if self._ws is not None and not self._ws.closed:
                try:
                    await self._ws.send_str(json.dumps({"type": "close"}))
                finally:
                    await self._ws.close()
        finally:
            self._ws = None
            if self._slot is not None:
                self._slot.free.release()
                self._slot.in_use -= 1
                self._slot = None
