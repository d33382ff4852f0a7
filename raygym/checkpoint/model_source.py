"""What ``raygym serve`` and ``raygym eval`` are pointed at, resolved to an HF model directory.

A source is one of:

- a run directory (``config.json`` of a run + its checkpoints): its newest complete checkpoint;
- a checkpoint save directory (``<run>/checkpoints``, any fsspec URL): its newest complete checkpoint;
- one checkpoint (``<run>/checkpoints/iter_0000019``);
- a Hugging Face model directory (``config.json`` + weights), or ``builtin:tiny-qwen3``;
- a LoRA adapter directory (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``).

A LoRA run's checkpoint (or an adapter directory) resolves to its base model plus the adapter: ``hf_dir`` is the
base model (the one ``adapter_config.json`` names), ``adapter_dir`` a local copy of the adapter; the engines
serve the base with the adapter beside it, as they did in training.

Checkpoints are found with :func:`raygym.checkpoint.store.list_checkpoints` and turned into an HF directory
with :func:`raygym.checkpoint.store.export_hf`, so whatever the checkpoint format is, a source resolves the
same way. The run's ``config.json`` (when there is one) travels along: eval reuses its seed, reward and
eval settings.

>>> src = resolve_model_source("builtin:tiny-qwen3", cache_dir=__import__("tempfile").mkdtemp())
>>> src.kind, src.rollout_id, src.name
('hf', None, 'tiny-qwen3')
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raygym.errors import ConfigError

RUN_CONFIG = "config.json"


@dataclass(frozen=True)
class ModelSource:
    """A resolved source: the local HF directory to load, and where it came from."""

    hf_dir: str  # local HF model directory the engines load
    kind: str  # "hf" | "checkpoint"
    name: str  # a short model name (served model id, eval table title)
    checkpoint: str | None = None  # URL of the checkpoint it was exported from
    rollout_id: int | None = None  # the training step of that checkpoint
    run_dir: str | None = None  # the run the checkpoint belongs to, when found
    run_config: dict[str, Any] | None = field(default=None, repr=False)  # that run's resolved config.json
    adapter_dir: str | None = None  # a LoRA adapter (PEFT directory) served beside hf_dir's weights


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url)


def _read_json(url: str) -> dict[str, Any] | None:
    fs, path = _fs(url)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path, "r") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _parent(url: str) -> str:
    head, _, _ = url.rstrip("/").rpartition("/")
    return head or "/"


def _same(a: str, b: str) -> bool:
    return _fs(a)[1].rstrip("/") == _fs(b)[1].rstrip("/")


def is_run_config(config: dict[str, Any] | None) -> bool:
    """True for a raygym run's ``config.json`` (not an HF model's)."""
    return config is not None and isinstance(config.get("recipe"), dict) and isinstance(config.get("model"), dict)


def _run_around(checkpoint_dir: str) -> tuple[str | None, dict[str, Any] | None]:
    """The run owning a checkpoint save directory: ``<run>/checkpoints`` -> ``<run>`` when its config says so."""
    candidate = _parent(checkpoint_dir)
    config = _read_json(_join(candidate, RUN_CONFIG))
    if is_run_config(config):
        return candidate, config
    return None, None


def _checkpoint_dir_of_run(run_dir: str, config: dict[str, Any]) -> str:
    save = str(config["recipe"].get("save") or "")
    base = str(config.get("output_dir") or run_dir)
    # The run may have moved since it was written: fall back to <run_dir>/checkpoints.
    configured = save or _join(base, "checkpoints")
    fs, path = _fs(configured)
    return configured if fs.exists(path) else _join(run_dir, "checkpoints")


def _short_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1].removeprefix("builtin:")


def _export(info: Any, cache_dir: str) -> str:
    """Export the checkpoint ``info`` once into ``cache_dir``; an export of the same manifest is reused."""
    from raygym.checkpoint.store import export_hf

    digest = hashlib.blake2b(json.dumps([info.path, info.manifest], sort_keys=True, default=str).encode(),
                             digest_size=6).hexdigest()
    out = Path(cache_dir) / "exports" / f"{_short_name(info.path)}-{digest}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export_hf(info.path, str(out))


def _export_adapter(info: Any, cache_dir: str) -> str:
    """Copy a LoRA checkpoint's adapter once into ``cache_dir`` (reused for the same manifest)."""
    from raygym.checkpoint.store import export_adapter
    from raygym.lora import is_adapter_dir

    digest = hashlib.blake2b(json.dumps([info.path, info.manifest], sort_keys=True, default=str).encode(),
                             digest_size=6).hexdigest()
    out = Path(cache_dir) / "exports" / f"{_short_name(info.path)}-adapter-{digest}"
    if is_adapter_dir(out):
        return str(out)
    return export_adapter(info.path, str(out))


def _from_checkpoint(info: Any, cache_dir: str | None, run_dir: str | None, config: dict[str, Any] | None,
                     label: str) -> ModelSource:
    from raygym.checkpoint.store import adapter_base, checkpoint_adapter

    if cache_dir is None:  # the run's own cache when it is on this machine (Ray workers see it as the run does)
        from raygym.builtin import default_cache_dir

        cache_dir = f"{run_dir}/cache" if run_dir and "://" not in run_dir else default_cache_dir()
    if checkpoint_adapter(info.path) is not None:  # a LoRA run's: the base model plus the adapter
        adapter = _export_adapter(info, cache_dir)
        base = (config or {}).get("model", {}).get("hf_checkpoint")
        return ModelSource(
            hf_dir=adapter_base(adapter, base if base and Path(str(base), "config.json").is_file() else None),
            kind="checkpoint", name=f"{label}-{_short_name(info.path)}", checkpoint=info.path,
            rollout_id=info.rollout_id, run_dir=run_dir, run_config=config, adapter_dir=adapter,
        )
    return ModelSource(
        hf_dir=_export(info, cache_dir), kind="checkpoint", name=f"{label}-{_short_name(info.path)}",
        checkpoint=info.path, rollout_id=info.rollout_id, run_dir=run_dir, run_config=config,
    )


def resolve_model_source(source: str, cache_dir: str | None = None) -> ModelSource:
    """Resolve ``source`` (see the module docstring). Checkpoints are exported under
    ``<cache_dir>/exports`` (default: the run's ``cache/``, else ``$RAYGYM_CACHE``), builtin models
    materialised under ``<cache_dir>/models``.

    Raises :class:`ConfigError` naming the source when it is none of the accepted kinds, or a run or
    save directory without a complete checkpoint.
    """
    from raygym.builtin import is_builtin, resolve_model_path
    from raygym.checkpoint.store import list_checkpoints

    if not source:
        raise ConfigError("checkpoint='': give a run directory, a checkpoint, or an HF model directory")
    if is_builtin(source):
        return ModelSource(resolve_model_path(source, cache_dir), "hf", _short_name(source))
    fs, path = _fs(source)
    if not fs.exists(path):
        raise ConfigError(f"checkpoint={source!r}: nothing there; give a run directory, a checkpoint or an HF "
                          "model directory")
    config = _read_json(_join(source, RUN_CONFIG))
    if is_run_config(config):  # a run directory
        assert config is not None
        saved = list_checkpoints(_checkpoint_dir_of_run(source, config))
        if not saved:
            raise ConfigError(f"checkpoint={source!r}: this run has no complete checkpoint (it saves every "
                              "save_interval steps); point at an HF directory such as its hf/ instead")
        return _from_checkpoint(saved[-1], cache_dir, source, config, str(config.get("run_id") or _short_name(source)))
    saved = list_checkpoints(source)
    if saved:  # a save directory
        run_dir, run_config = _run_around(source)
        label = str(run_config.get("run_id")) if run_config else _short_name(_parent(source))
        return _from_checkpoint(saved[-1], cache_dir, run_dir, run_config, label)
    parent = _parent(source)
    match = [info for info in list_checkpoints(parent) if _same(info.path, source)]
    if match:  # one checkpoint
        run_dir, run_config = _run_around(parent)
        label = str(run_config.get("run_id")) if run_config else _short_name(_parent(parent))
        return _from_checkpoint(match[0], cache_dir, run_dir, run_config, label)
    from raygym.lora import is_adapter_dir

    if "://" not in source and is_adapter_dir(path):  # a LoRA adapter: its base model plus it
        from raygym.checkpoint.store import adapter_base

        return ModelSource(adapter_base(path), "adapter", _short_name(source), adapter_dir=path)
    if config is not None:  # an HF model directory (config.json of a model)
        return ModelSource(resolve_model_path(source, cache_dir), "hf", _short_name(source))
    raise ConfigError(
        f"checkpoint={source!r}: not a run directory (config.json + checkpoints/), a checkpoint directory "
        "with a complete manifest, nor an HF model directory (config.json + weights)"
    )


__all__ = ["ModelSource", "is_run_config", "resolve_model_source"]
