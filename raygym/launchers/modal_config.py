"""``ModalConfig``: the settings that only make sense on Modal (GPU type, image, app metadata, overlays).

The training recipe (:class:`raygym.Recipe`) stays Modal-free; this model carries what the
``Qwen3_4B_Recipe`` reference page lists as Modal-only, under the same names where they exist:
``gpu_type``, ``memory``, ``cpu``, ``cloud``, ``region``, ``image_run_commands``, ``image_env``,
``image_overlay``, ``app_tags``, ``name``, ``train_function_kwargs``, ``patch_files``, plus the source
overlays (``local_raygym``; ``git_repository`` + ``git_revision``) and the launcher's own knobs.

>>> cfg = ModalConfig(gpu_type="H200", region="us-east")
>>> cfg.function_gpu(8)
'H200:8'
>>> ModalConfig(git_repository="https://github.com/x/raygym", git_revision="main")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
raygym.errors.ConfigError: git_revision='main': branches and tags are rejected because they can move between runs; ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raygym.errors import ConfigError

_SHA = re.compile(r"[0-9a-f]{40}")
# Function kwargs that have a dedicated ModalConfig field (or are set from the recipe).
_RESERVED_FUNCTION_KWARGS = {
    "gpu": "gpu_type (the count comes from the recipe's actor_num_gpus_per_node)",
    "image": "image_run_commands / image_env / image_overlay",
    "cpu": "cpu",
    "memory": "memory",
    "cloud": "cloud",
    "region": "region",
    "volumes": "the *_volume fields",
    "secrets": "secrets",
    "include_source": "local_raygym / git_repository (the launcher ships raygym's source)",
}
# Fields that CLI flags cannot express (Python objects).
_PYTHON_ONLY = {"image_overlay"}


class ModalConfig(BaseModel):
    """Modal-only settings for :mod:`raygym.launchers.modal_app`. Invalid values raise ``ConfigError``."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    gpu_type: str = "H100"  # Modal GPU type for every node; the count is actor_num_gpus_per_node
    memory: int | tuple[int, int] | None = None  # MiB: request or (request, limit)
    cpu: float | tuple[float, float] | None = None  # cores per container: request or (request, limit)
    cloud: str | None = None
    region: str | None = None
    image_run_commands: list[str] = Field(default_factory=list)
    image_env: dict[str, str] = Field(default_factory=dict)
    image_overlay: Callable[[Any], Any] | None = Field(default=None, exclude=True)  # Image -> Image
    app_tags: dict[str, str] = Field(default_factory=dict)
    name: str = ""  # Modal app name; derived from the preset when empty
    train_function_kwargs: dict[str, Any] = Field(default_factory=dict)
    local_raygym: str | None = None  # local raygym checkout mounted over the image's copy (no rebuild)
    git_repository: str | None = None  # public HTTPS git repository installed over the image's raygym
    git_revision: str | None = None  # full 40-hex commit of git_repository
    patch_files: list[str] = Field(default_factory=list)  # local scripts run at image build (python/sh)
    # The launcher's own knobs.
    python_version: str = "3.11"
    cuda_image: str = "nvidia/cuda:12.8.1-devel-ubuntu22.04"
    secrets: list[str] = Field(default_factory=lambda: ["wandb-secret", "huggingface-secret"])
    serve_secret: str = "raygym-serve-secret"  # Modal secret holding RAYGYM_SERVE_API_KEY (modal_app serve)
    hf_cache_volume: str = "raygym-hf-cache"
    data_volume: str = "raygym-data"
    checkpoints_volume: str = "raygym-checkpoints"
    timeout_s: int = 24 * 3600
    join_timeout_s: float = 600.0
    node_dead_after_s: float = 60.0
    head_port: int = 6379
    dashboard_port: int = 8265

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(_explain(exc)) from None

    @field_validator("gpu_type")
    @classmethod
    def _gpu_type(cls, v: str) -> str:
        if not v or ":" in v:
            raise ValueError(
                f"gpu_type={v!r}: give the GPU type only (e.g. 'H100'); the count per node comes from "
                "the recipe's actor_num_gpus_per_node"
            )
        return v

    @field_validator("memory", "cpu")
    @classmethod
    def _request_limit(cls, v: Any, info: Any) -> Any:
        values = v if isinstance(v, tuple) else (v,)
        if v is not None and any(x <= 0 for x in values):
            raise ValueError(f"{info.field_name}={v!r}: must be positive; set a request or (request, limit)")
        if isinstance(v, tuple) and v[0] > v[1]:
            raise ValueError(f"{info.field_name}={v!r}: the request exceeds the limit; use (request, limit)")
        return v

    @field_validator("git_revision")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        if v is not None and not _SHA.fullmatch(v):
            raise ValueError(
                f"git_revision={v!r}: branches and tags are rejected because they can move between runs; "
                f"use the full 40-character commit SHA (git rev-parse {v})"
            )
        return v

    @field_validator("git_repository")
    @classmethod
    def _https(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("https://"):
            raise ValueError(f"git_repository={v!r}: must be a public https:// URL")
        return v

    @field_validator("train_function_kwargs")
    @classmethod
    def _own_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if key in _RESERVED_FUNCTION_KWARGS:
                raise ValueError(
                    f"train_function_kwargs[{key!r}]: set by the launcher; use ModalConfig "
                    f"{_RESERVED_FUNCTION_KWARGS[key]} instead"
                )
        return v

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: int) -> int:
        if not 1 <= v <= 24 * 3600:
            raise ValueError(f"timeout_s={v}: Modal functions run between 1 s and 86400 s (24 h)")
        return v

    @model_validator(mode="after")
    def _overlays(self) -> ModalConfig:
        if (self.git_repository is None) != (self.git_revision is None):
            raise ValueError(
                f"git_repository={self.git_repository!r}, git_revision={self.git_revision!r}: "
                "set both (an https repository and its 40-hex commit) or neither"
            )
        if self.local_raygym and self.git_repository:
            raise ValueError(
                f"local_raygym={self.local_raygym!r} and git_repository={self.git_repository!r}: "
                "choose one source overlay"
            )
        return self

    def function_gpu(self, gpus_per_node: int) -> str:
        """Modal's GPU request for one node, e.g. ``'H100:8'``."""
        if gpus_per_node < 1:
            raise ConfigError(
                f"actor_num_gpus_per_node={gpus_per_node}: Modal clusters need GPU nodes; set it to >= 1"
            )
        return f"{self.gpu_type}:{gpus_per_node}"

    def function_kwargs(self, gpus_per_node: int) -> dict[str, Any]:
        """Keyword arguments for ``app.function`` (GPU, timeout, placement), then ``train_function_kwargs``.

        >>> ModalConfig(memory=65536).function_kwargs(8)["gpu"]
        'H100:8'
        """
        kwargs: dict[str, Any] = {"gpu": self.function_gpu(gpus_per_node), "timeout": self.timeout_s}
        for key in ("cpu", "memory", "cloud", "region"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return {**kwargs, **self.train_function_kwargs}

    @staticmethod
    def cluster_kwargs(total_nodes: int) -> dict[str, Any]:
        """Keyword arguments for ``modal.clustered``: one container per node, RDMA when multi-node."""
        if total_nodes < 1:
            raise ConfigError(f"total_nodes={total_nodes}: a run needs at least one node")
        return {"size": total_nodes, "rdma": total_nodes > 1}

    def to_json(self) -> str:
        """JSON of every field except Python-only ones (``image_overlay``); inverse of ``from_json``."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> ModalConfig:
        return cls(**json.loads(text))

    @classmethod
    def split_cli_args(cls, args: list[str]) -> tuple[ModalConfig, list[str]]:
        """Take the ``--modal-<field> VALUE`` flags out of ``args``; the rest are train flags.

        Values are JSON when they parse as JSON (``--modal-memory 65536``, ``--modal-app-tags '{"a":"b"}'``)
        and plain strings otherwise (``--modal-gpu-type H200``).

        >>> cfg, rest = ModalConfig.split_cli_args(["--modal-gpu-type", "H200", "--num-rollout", "3"])
        >>> cfg.gpu_type, rest
        ('H200', ['--num-rollout', '3'])
        """
        fields: dict[str, Any] = {}
        rest: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if not arg.startswith("--modal-"):
                rest.append(arg)
                i += 1
                continue
            flag, eq, inline = arg.partition("=")
            name = flag[len("--modal-") :].replace("-", "_")
            if name not in cls.model_fields or name in _PYTHON_ONLY:
                raise ConfigError(f"{flag}: unknown Modal flag; known: {', '.join(sorted(_cli_fields()))}")
            if eq:
                raw = inline
                i += 1
            elif i + 1 < len(args):
                raw = args[i + 1]
                i += 2
            else:
                raise ConfigError(f"{flag}: missing value; pass {flag} VALUE")
            fields[name] = _parse_value(raw)
        return cls(**fields), rest


def launch_args_from_argv(
    argv: list[str], script: str = "modal_app.py", module: str = "raygym.launchers.modal_app"
) -> list[str] | None:
    """The flags after the app in ``modal run [opts] -m raygym.launchers.modal_app [flags]`` (or after the file
    ``.../modal_app.py``, a ``::function`` suffix allowed); None if absent.

    >>> launch_args_from_argv(["modal", "run", "-m", "raygym.launchers.modal_app", "--preset", "tiny"])
    ['--preset', 'tiny']
    >>> launch_args_from_argv(["modal", "run", "raygym/launchers/modal_app.py::main", "--num-rollout", "3"])
    ['--num-rollout', '3']
    >>> launch_args_from_argv(["pytest", "tests/launcher_modal/test_modal_app.py", "-x"]) is None
    True
    """
    for i, arg in enumerate(argv):
        ref = arg.split("::")[0]
        if ref == module or PurePath(ref).name == script:
            return list(argv[i + 1 :])
    return None


def _cli_fields() -> list[str]:
    return ["--modal-" + n.replace("_", "-") for n in ModalConfig.model_fields if n not in _PYTHON_ONLY]


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        field_name = ".".join(str(x) for x in err.get("loc", ()))
        if field_name and not msg.startswith(field_name.split(".")[0]):
            msg = f"{field_name}={err.get('input')!r}: {msg}; fix the ModalConfig field {field_name}"
        parts.append(msg)
    return "; ".join(parts)
