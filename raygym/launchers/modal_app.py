"""Run raygym on Modal GPU nodes: ``modal run -m raygym.launchers.modal_app --preset qwen3-4b [flags]``.

From a checkout, ``modal run raygym/launchers/modal_app.py ...`` works too. Flags starting with ``--modal-`` set
:class:`~raygym.launchers.modal_config.ModalConfig` fields
(``--modal-gpu-type H200``, ``--modal-region us-east``); every other flag is a train flag for
``python -m raygym.train``. The app requests ``recipe.total_nodes()`` clustered containers of
``gpu_type:actor_num_gpus_per_node`` (RDMA when multi-node). Rank 0 starts the Ray head and waits for
every node, the other ranks join with retries and leave when the head is gone; then rank 0 submits
the same job :mod:`raygym.launchers.ray_job` submits anywhere else, streams its logs, commits the checkpoint
volume whenever new files appear, and stops the job when a node stays dead for ``node_dead_after_s``.

From Python (e.g. a script of your own that Modal runs)::

    from raygym.launchers.modal_app import build_app
    run = build_app(["--preset", "qwen3-4b"], ModalConfig(gpu_type="H200"))  # run.app, run.train_fn, run.launch

Serving a checkpoint (``raygym serve`` in a GPU container, exposed as a Modal web endpoint; the API key
comes from the Modal secret ``serve_secret``, default ``raygym-serve-secret`` holding
``RAYGYM_SERVE_API_KEY``)::

    modal secret create raygym-serve-secret RAYGYM_SERVE_API_KEY=...
    RAYGYM_MODAL_SERVE='/checkpoints/my-run --max-replicas 2 --modal-gpu-type L4' \\
        modal deploy -m raygym.launchers.modal_app

or from Python: ``build_serve_app(["/checkpoints/my-run", "--replicas", "1"])``.

Where the containers' raygym comes from: from a checkout, the image installs a copy of it; from an installed
raygym, the image installs its requirements (from the package's metadata) and the installed package's source is
added when a container starts (:mod:`raygym.launchers.source`). ``local_raygym`` / ``git_repository`` replace it.

Every decision about the cluster lives in :mod:`raygym.launchers.bootstrap`; this file only wires Modal to it.
This is the one module of raygym that imports ``modal`` (``pip install 'raygym[modal]'``).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

# `modal run raygym/launchers/modal_app.py` imports this file by its path, as the top-level module `modal_app`;
# Modal then ships this file alone, and the containers import the rest of raygym from the image.
_RUN_AS_FILE = not __package__
if _RUN_AS_FILE:  # run from a checkout: make its raygym importable from any directory
    _CHECKOUT = Path(__file__).resolve().parent.parent.parent
    if (_CHECKOUT / "raygym" / "__init__.py").is_file() and str(_CHECKOUT) not in sys.path:
        sys.path.insert(0, str(_CHECKOUT))

import modal  # noqa: E402

from raygym.errors import ConfigError, RaygymError  # noqa: E402
from raygym.launchers import bootstrap, source  # noqa: E402
from raygym.launchers.modal_config import ModalConfig, launch_args_from_argv  # noqa: E402
from raygym.launchers.ray_job import resolve_recipe, submit_train_job  # noqa: E402

__all__ = ["Launch", "ModalRun", "ModalServe", "ServeLaunch", "build_app", "build_image", "build_serve_app",
           "build_volumes", "plan_launch", "plan_serve", "run_cluster", "serve_web"]

HF_CACHE_DIR = "/root/.cache/huggingface"
DATA_DIR = "/data"
CHECKPOINTS_DIR = "/checkpoints"
REMOTE_REPO = "/root/raygym-src"
REMOTE_OVERLAY = "/root/raygym-overlay"  # local_raygym is mounted here and put first on PYTHONPATH
APP_NAME_ENV = "RAYGYM_MODAL_APP"
SERVE_ENV = "RAYGYM_MODAL_SERVE"  # set locally: the serve flags; makes this file's app the serving app
SERVE_ARGS_ENV = "RAYGYM_MODAL_SERVE_ARGS"  # inside the serving container: the serve flags as JSON
SERVE_PORT = 8000
# Set by the launcher (the port Modal routes to; the key from the Modal secret).
_SERVE_FLAGS_OWNED = ("--host", "--port", "--api-key", "--api-key-file", "--detach")
DEFAULT_ARGS = ["--preset", "qwen3-4b"]
IMAGE_EXTRAS = ("sglang", "megatron")  # raygym extras the image installs: the engine and the Megatron trainer
_REPO_IGNORE = ["**/.git", "**/runs", "**/__pycache__", "**/*.egg-info", "**/.venv", "**/.pytest_cache"]


@dataclass(frozen=True)
class Launch:
    """One run's Modal shape: the train flags, the Modal settings and what the recipe asks for."""

    train_args: list[str]
    modal_config: ModalConfig
    total_nodes: int
    gpus_per_node: int
    app_name: str


def plan_launch(args: list[str], modal_config: ModalConfig | None = None) -> Launch:
    """Split ``--modal-*`` flags from train flags and size the cluster from the recipe they describe."""
    from_flags, train_args = ModalConfig.split_cli_args(list(args))
    if modal_config is None:
        modal_config = from_flags
    else:  # explicit config, with any --modal-* flags on top
        modal_config = modal_config.model_copy(update=from_flags.model_dump(exclude_unset=True))
    recipe = resolve_recipe(train_args)
    preset = next((train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--preset"), None)
    name = modal_config.name or f"raygym-{preset or 'run'}"
    return Launch(train_args, modal_config, recipe.total_nodes(), recipe.actor_num_gpus_per_node, name)


def build_image(cfg: ModalConfig) -> modal.Image:
    """CUDA image with raygym[sglang,megatron]: installed from this checkout, or (an installed raygym) its
    requirements, with the installed package's source added at container start; then the overlays."""
    root = source.CHECKOUT_ROOT
    image = (
        modal.Image.from_registry(cfg.cuda_image, add_python=cfg.python_version)
        .apt_install("git")
        .env({"HF_HOME": HF_CACHE_DIR, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"})
    )
    if root is not None:
        image = image.add_local_dir(root, REMOTE_REPO, copy=True, ignore=_REPO_IGNORE).run_commands(
            f"pip install '{REMOTE_REPO}[{','.join(IMAGE_EXTRAS)}]'"
        )
    elif _RUN_AS_FILE:
        raise ConfigError(f"{__file__}: an installed raygym's Modal launcher runs as a module: "
                          "modal run -m raygym.launchers.modal_app [flags]")
    else:
        image = image.pip_install(*source.base_requirements(), *source.extra_requirements(IMAGE_EXTRAS))
    if cfg.git_repository:
        image = image.run_commands(
            f"pip install --no-deps --force-reinstall 'git+{cfg.git_repository}@{cfg.git_revision}'"
        )
    for patch in cfg.patch_files:
        remote = f"/root/patches/{Path(patch).name}"
        runner = "bash" if patch.endswith(".sh") else "python"
        image = image.add_local_file(patch, remote, copy=True).run_commands(f"{runner} {remote}")
    if cfg.image_run_commands:
        image = image.run_commands(*cfg.image_run_commands)
    if cfg.image_env or cfg.local_raygym:
        overlay_path = {"PYTHONPATH": REMOTE_OVERLAY} if cfg.local_raygym else {}
        image = image.env({**cfg.image_env, **overlay_path})
    # Mounted at container start (no rebuild when they change); must come after every build step. The functions
    # ship no package source of their own (include_source): the containers' raygym is the image's, or this one.
    if root is None and not (cfg.git_repository or cfg.local_raygym):  # an installed raygym: its own source
        image = image.add_local_python_source("raygym")
    if cfg.local_raygym:
        package = Path(cfg.local_raygym).expanduser() / "raygym"
        if not (package / "__init__.py").is_file():
            raise ConfigError(
                f"local_raygym={cfg.local_raygym!r}: no raygym/ package there; point it at a checkout"
            )
        image = image.add_local_dir(package, f"{REMOTE_OVERLAY}/raygym")
    return cfg.image_overlay(image) if cfg.image_overlay else image


def build_volumes(cfg: ModalConfig) -> dict[str | PurePosixPath, modal.Volume | modal.CloudBucketMount]:
    """HF cache, data and checkpoints volumes (created on first use)."""
    return {
        HF_CACHE_DIR: modal.Volume.from_name(cfg.hf_cache_volume, create_if_missing=True),
        DATA_DIR: modal.Volume.from_name(cfg.data_volume, create_if_missing=True),
        CHECKPOINTS_DIR: modal.Volume.from_name(cfg.checkpoints_volume, create_if_missing=True),
    }


@dataclass(frozen=True)
class ModalRun:
    """A built app, its clustered training function and the launch it was sized for."""

    app: modal.App
    train_fn: modal.Function
    launch: Launch


def build_app(args: list[str], modal_config: ModalConfig | None = None) -> ModalRun:
    """The Modal app and its clustered training function for ``args`` (train flags + ``--modal-*``)."""
    launch = plan_launch(args, modal_config)
    cfg = launch.modal_config
    app = modal.App(launch.app_name, tags={"framework": "raygym", **cfg.app_tags})
    clustered = getattr(modal, "clustered", None) or modal.experimental.clustered
    train_fn = app.function(
        image=build_image(cfg),
        volumes=build_volumes(cfg),
        secrets=[modal.Secret.from_name(name) for name in cfg.secrets],
        env={APP_NAME_ENV: launch.app_name},
        include_source=_RUN_AS_FILE,
        **cfg.function_kwargs(launch.gpus_per_node),
    )(clustered(**cfg.cluster_kwargs(launch.total_nodes))(run_cluster))
    return ModalRun(app, train_fn, launch)


# ---------------------------------------------------------------- serving a checkpoint


@dataclass(frozen=True)
class ServeLaunch:
    """One endpoint's Modal shape: the ``raygym serve`` flags and the GPUs of its container."""

    serve_args: list[str]  # SOURCE first, then raygym serve flags
    modal_config: ModalConfig
    gpus: int  # GPUs of the container: GPUs per replica x the most replicas
    app_name: str


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def plan_serve(args: list[str], modal_config: ModalConfig | None = None) -> ServeLaunch:
    """Split ``--modal-*`` flags from ``raygym serve`` flags and size the container.

    One container is one Ray node running every replica of the deployment, so it gets
    ``gpus_per_replica x max(replicas, max_replicas)`` GPUs (at least one)."""
    from_flags, serve_args = ModalConfig.split_cli_args(list(args))
    if modal_config is None:
        modal_config = from_flags
    else:
        modal_config = modal_config.model_copy(update=from_flags.model_dump(exclude_unset=True))
    if not serve_args or serve_args[0].startswith("-"):
        raise ConfigError("serve: give the checkpoint first, e.g. /checkpoints/<run> [raygym serve flags]; "
                          "it must be on a Modal volume (/checkpoints) or an object-store URL")
    for flag in _SERVE_FLAGS_OWNED:
        if _flag_value(serve_args, flag) is not None or flag in serve_args:
            raise ConfigError(f"{flag}: set by the Modal launcher (port {SERVE_PORT}, the key from the Modal secret "
                              f"{modal_config.serve_secret!r}); remove it")
    try:
        per_replica = int(_flag_value(serve_args, "--gpus-per-replica") or 1)
        replicas = int(_flag_value(serve_args, "--max-replicas") or _flag_value(serve_args, "--replicas") or 1)
    except ValueError as exc:
        raise ConfigError(f"serve flags: {exc}; --gpus-per-replica / --replicas / --max-replicas take integers") from None
    if _flag_value(serve_args, "--gpus-per-replica") is None:  # Modal containers have GPUs: use them
        serve_args = [*serve_args, "--gpus-per-replica", str(per_replica)]
    name = modal_config.name or "raygym-serve"
    return ServeLaunch(serve_args, modal_config, max(1, per_replica * replicas), name)


@dataclass(frozen=True)
class ModalServe:
    """A built serving app, its web-server function and the launch it was sized for."""

    app: modal.App
    serve_fn: modal.Function
    launch: ServeLaunch


def build_serve_app(args: list[str], modal_config: ModalConfig | None = None) -> ModalServe:
    """The Modal app serving ``args`` (``SOURCE [raygym serve flags] [--modal-* flags]``) on port 8000."""
    launch = plan_serve(args, modal_config)
    cfg = launch.modal_config
    app = modal.App(launch.app_name, tags={"framework": "raygym", **cfg.app_tags})
    secret_names = [cfg.serve_secret, *(s for s in cfg.secrets if s != cfg.serve_secret)]
    web = modal.web_server(SERVE_PORT, startup_timeout=cfg.join_timeout_s)(serve_web)
    concurrent = getattr(modal, "concurrent", None)
    if concurrent is not None:  # one container answers many requests at once (Ray Serve queues them)
        web = concurrent(max_inputs=1000)(web)
    serve_fn: modal.Function[..., Any, Any] = app.function(
        image=build_image(cfg),
        volumes=build_volumes(cfg),
        secrets=[modal.Secret.from_name(name) for name in secret_names],
        env={APP_NAME_ENV: launch.app_name, SERVE_ARGS_ENV: json.dumps(launch.serve_args)},
        include_source=_RUN_AS_FILE,
        **cfg.function_kwargs(launch.gpus),
    )(web)
    return ModalServe(app, serve_fn, launch)


def serve_web() -> None:
    """Inside the serving container: start ``raygym serve`` on port 8000 (Modal routes the endpoint to it)."""
    args = json.loads(os.environ[SERVE_ARGS_ENV])
    command = [sys.executable, "-m", "raygym", "serve", *args, "--host", "0.0.0.0", "--port", str(SERVE_PORT)]
    subprocess.Popen(command, env=dict(os.environ))  # the key arrives as RAYGYM_SERVE_API_KEY from the secret


# ---------------------------------------------------------------- inside the containers


def run_cluster(train_args: list[str], modal_config_json: str, gpus_per_node: int, ray_token: str) -> dict:
    """Every container runs this: rank 0 becomes the Ray head and runs the job, the others join it."""
    cfg = ModalConfig.from_json(modal_config_json)
    spec = _cluster_spec(cfg, gpus_per_node)
    # One token per run, known only to this run's containers: token auth without a stored secret.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_token}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_token})
    checkpoints = _VolumeCommitter(cfg.checkpoints_volume, CHECKPOINTS_DIR)
    try:
        if spec.is_head:
            return _run_head(spec, cfg, train_args, env, checkpoints)
        _run_worker(spec, env, checkpoints)
        return {"rank": spec.rank}
    finally:
        checkpoints.commit_if_changed()


def _cluster_spec(cfg: ModalConfig, gpus_per_node: int) -> bootstrap.ClusterSpec:
    if hasattr(modal, "Cluster"):
        cluster = modal.Cluster.from_context()
        rank, ips = cluster.container_rank(), cluster.container_ips()
    else:
        info = modal.experimental.get_cluster_info()
        rank, ips = info.rank, info.container_ips
    return bootstrap.ClusterSpec(rank, tuple(ips), gpus_per_node, cfg.head_port, cfg.dashboard_port)


def _run_head(
    spec: bootstrap.ClusterSpec,
    cfg: ModalConfig,
    train_args: list[str],
    env: dict,
    checkpoints: _VolumeCommitter,
) -> dict:
    subprocess.run(bootstrap.head_command(spec), check=True, env=env)
    import ray

    ray.init(address=bootstrap.ray_address(spec), log_to_driver=False)

    def alive() -> set[str]:
        return bootstrap.alive_node_ips(ray.nodes())

    took = bootstrap.wait_for_nodes(spec, alive, cfg.join_timeout_s)
    print(f"all {spec.size} nodes joined in {took:.0f} s", flush=True)
    dog = bootstrap.NodeWatchdog(spec, cfg.node_dead_after_s)

    def watchdog() -> str | None:
        checkpoints.commit_if_changed()  # commit after each save, not only at the end
        failure = dog.observe(time.monotonic(), alive())
        if failure is None:
            return None
        return (
            f"rank {failure.rank} ({failure.ip}) dead for {failure.dead_for_s:.0f} s\n{failure.diagnostics}"
        )

    outcome = submit_train_job(
        bootstrap.dashboard_address(spec), train_args, environ=env, working_dir=None, watchdog=watchdog
    )
    if not outcome.succeeded:
        raise RaygymError(f"job {outcome.job_id} ended {outcome.status}: {outcome.message}")
    return {"job_id": outcome.job_id, "status": outcome.status}


def _run_worker(spec: bootstrap.ClusterSpec, env: dict, checkpoints: _VolumeCommitter) -> None:
    def join() -> str | None:
        proc = subprocess.run(bootstrap.worker_command(spec), env=env, capture_output=True, text=True)
        return None if proc.returncode == 0 else (proc.stderr or proc.stdout)[-2000:]

    bootstrap.run_with_retries(join, bootstrap.backoff_delays(10), f"rank {spec.rank} joining the Ray head")
    watch = bootstrap.HeadWatch(grace_s=30.0)
    while not watch.observe(time.monotonic(), _reachable(spec.head_ip, spec.head_port)):
        checkpoints.commit_if_changed()
        time.sleep(5.0)
    print(f"rank {spec.rank}: Ray head unreachable for 30 s; leaving", flush=True)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=3):
            return True
    except OSError:
        return False


class _VolumeCommitter:
    """Commits a mounted volume whenever files under its mount point changed since the last commit."""

    def __init__(self, volume_name: str, mount: str) -> None:
        self._volume = modal.Volume.from_name(volume_name)
        self._mount = mount
        self._seen = bootstrap.tree_signature(mount)

    def commit_if_changed(self) -> None:
        now = bootstrap.tree_signature(self._mount)
        if now != self._seen:
            self._volume.commit()
            self._seen = now


# ---------------------------------------------------------------- `modal run` entry


def _args_for_this_process() -> list[str]:
    from_argv = launch_args_from_argv(sys.argv)
    return from_argv if from_argv else list(DEFAULT_ARGS)


RUN: ModalRun | None = None
SERVE: ModalServe | None = None
if modal.is_local() and os.environ.get(SERVE_ENV):  # `modal deploy|serve -m raygym.launchers.modal_app`
    SERVE = build_serve_app(shlex.split(os.environ[SERVE_ENV]))
    app = SERVE.app
elif modal.is_local():
    RUN = build_app(_args_for_this_process())
    app = RUN.app
else:  # inside a container Modal only needs run_cluster / serve_web; the app carries no layout here
    app = modal.App(os.environ.get(APP_NAME_ENV, "raygym"))


@app.local_entrypoint()
def main(*arglist: str) -> None:
    """``modal run -m raygym.launchers.modal_app [--modal-* flags] [train flags]``."""
    if SERVE is not None:
        raise RaygymError(f"{SERVE_ENV} is set: this app serves; use `modal deploy` or `modal serve`, not `modal run`")
    assert RUN is not None, "main() runs on the local side only"
    launch = RUN.launch
    _, train_args = ModalConfig.split_cli_args(list(arglist))
    if arglist and train_args != launch.train_args:  # the app was sized from sys.argv at import
        raise RaygymError(f"entrypoint flags {train_args} differ from the ones the app was built for")
    print(f"raygym on Modal: {launch.total_nodes} x {launch.modal_config.function_gpu(launch.gpus_per_node)}")
    result: Any = RUN.train_fn.remote(
        launch.train_args, launch.modal_config.to_json(), launch.gpus_per_node, secrets.token_hex(32)
    )
    print(json.dumps(result))
