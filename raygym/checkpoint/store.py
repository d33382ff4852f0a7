"""Checkpoints through fsspec (any URL: local paths, ``memory://``, object stores) and HF export.

Trainers write SHARDED checkpoints (``raygym.checkpoint.sharded``, format ``raygym-checkpoint/2``): every
rank writes its own blocks with ``torch.distributed.checkpoint`` and the checkpoint loads on any world
size. This module owns what every format shares: the ``iter_{rollout_id:07d}`` directories, the manifest
(written LAST, temp file + rename on local disks, listing every file and its size), finding the newest
complete checkpoint, reading one whole (:func:`load_checkpoint`) and the HF export (:func:`export_hf`).

:func:`save_checkpoint` writes the single-process format ``raygym-checkpoint/1`` from FULL state dicts
(what trainers did before sharding: gather to rank 0, then pickle), still loadable everywhere:

- ``model.pt``: full (unsharded) model state dict in HF names, fp32 on CPU;
- ``optimizer.pt``: full optimizer state keyed by parameter name (absent with ``no_save_optim``);
- ``trainer_state.pt``: LR-schedule state and RNG states (torch, CUDA, python, numpy);
- ``extra.json``: the caller's JSON state (data position, metrics step, ...);
- ``hf/``: the HF ``config.json`` and tokenizer files, so ``export_hf`` needs nothing else;
- ``manifest.json``: written last.

A directory without a manifest, or whose files do not match it, is incomplete (a crash mid-save) and is
skipped by ``latest_checkpoint`` with a warning.

>>> import torch
>>> path = save_checkpoint("memory://ckpt-doc", 3, model_state={"w": torch.ones(2)}, extra={"epoch": 1})
>>> info = latest_checkpoint("memory://ckpt-doc")
>>> info.rollout_id, load_checkpoint(info.path).extra
(3, {'epoch': 1})
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch

from raygym.checkpoint.files import (
    FORMAT,
    HF_SIDE_FILES,
    ITER_RE,
    MANIFEST,
    is_local,
    iter_dir_name,
    join_url,
    read_manifest,
    write_bytes_atomic,
    write_extra_and_hf_files,
)
from raygym.errors import ConfigError

log = logging.getLogger(__name__)




@dataclass(frozen=True)
class CheckpointInfo:
    path: str  # URL of the iter_XXXXXXX directory
    rollout_id: int
    manifest: dict[str, Any]


@dataclass
class LoadedCheckpoint:
    rollout_id: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    trainer_state: dict[str, Any]
    extra: dict[str, Any]
    path: str


def _torch_save(fs: fsspec.AbstractFileSystem, path: str, obj: Any) -> None:
    with fs.open(path, "wb") as f:
        torch.save(obj, f)


def _torch_load(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    with fs.open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def capture_rng_state() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), python ``random`` and numpy, in a weights_only-loadable form."""
    import numpy as np

    legacy_state = np.random.get_state()
    assert isinstance(legacy_state, tuple)  # the global generator is always MT19937
    kind, keys, pos, has_gauss, cached = legacy_state
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    dir_url: str,
    rollout_id: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    hf_source: str | None = None,
) -> str:
    """Write checkpoint ``rollout_id`` under ``dir_url`` and return its URL; the manifest goes last.

    ``extra`` must be JSON-serialisable. ``hf_source`` is a local HF model directory whose config and
    tokenizer files are copied into ``hf/`` (for ``export_hf``).
    """
    fs, root = fsspec.core.url_to_fs(dir_url)
    path = join_url(root, iter_dir_name(rollout_id))
    if fs.exists(join_url(path, MANIFEST)):
        fs.rm(join_url(path, MANIFEST))  # overwriting: the old manifest must not vouch for new files
    fs.makedirs(path, exist_ok=True)
    _torch_save(fs, join_url(path, "model.pt"), model_state)
    if optimizer_state is not None:
        _torch_save(fs, join_url(path, "optimizer.pt"), optimizer_state)
    _torch_save(fs, join_url(path, "trainer_state.pt"), trainer_state or {})
    write_extra_and_hf_files(fs, path, extra, hf_source)
    files = {}
    for entry in fs.find(path):
        rel = entry[len(path.rstrip("/")) + 1 :] if entry.startswith(path.rstrip("/")) else entry
        if rel != MANIFEST and ".tmp" not in rel:
            files[rel] = int(fs.size(entry))
    manifest = {
        "format": FORMAT,
        "rollout_id": rollout_id,
        "has_optimizer": optimizer_state is not None,
        "files": files,
        "created": time.time(),
    }
    write_bytes_atomic(fs, join_url(path, MANIFEST), json.dumps(manifest, indent=1).encode())
    return fs.unstrip_protocol(path) if not is_local(fs) else path


def list_checkpoints(dir_url: str) -> list[CheckpointInfo]:
    """Every COMPLETE checkpoint under ``dir_url``, oldest first; incomplete ones are logged and skipped."""
    fs, root = fsspec.core.url_to_fs(dir_url)
    if not fs.exists(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = ITER_RE.match(name)
        if not match or not fs.isdir(entry):
            continue
        manifest = read_manifest(fs, entry)
        if manifest is None:
            log.warning("checkpoint %s is incomplete (no valid manifest); ignoring it", entry)
            continue
        url = entry if is_local(fs) else fs.unstrip_protocol(entry)
        found.append(CheckpointInfo(url, int(match.group(1)), manifest))
    return sorted(found, key=lambda c: c.rollout_id)


def latest_checkpoint(dir_url: str) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``dir_url``, or None."""
    done = list_checkpoints(dir_url)
    return done[-1] if done else None


def load_checkpoint(path: str, *, load_optimizer: bool = True) -> LoadedCheckpoint:
    """Read one checkpoint directory (a ``CheckpointInfo.path``) whole, in this process, whatever its
    format and the world size that wrote it. ``load_optimizer=False`` = ``no_load_optim``."""
    fs, root = fsspec.core.url_to_fs(path)
    manifest = read_manifest(fs, root)
    if manifest is None:
        raise ConfigError(f"load={path!r}: not a complete raygym checkpoint (missing or invalid {MANIFEST})")
    with fs.open(join_url(root, "extra.json"), "r") as f:
        extra = json.load(f)
    if manifest.get("format") != FORMAT:
        from raygym.checkpoint.sharded import read_full_sharded

        model, optim, trainer_state = read_full_sharded(path, load_optimizer=load_optimizer)
        return LoadedCheckpoint(int(manifest["rollout_id"]), model, optim, trainer_state, extra, path)
    optim = None
    if load_optimizer and manifest.get("has_optimizer"):
        optim = _torch_load(fs, join_url(root, "optimizer.pt"))
    return LoadedCheckpoint(
        rollout_id=int(manifest["rollout_id"]),
        model_state=_torch_load(fs, join_url(root, "model.pt")),
        optimizer_state=optim,
        trainer_state=_torch_load(fs, join_url(root, "trainer_state.pt")),
        extra=extra,
        path=path,
    )


def resolve_start_rollout_id(start_rollout_id: int | None, loaded_rollout_id: int | None) -> int:
    """``start_rollout_id`` semantics: an explicit value wins; None continues after the stored step (0 if none)."""
    if start_rollout_id is not None:
        return start_rollout_id
    return 0 if loaded_rollout_id is None else loaded_rollout_id + 1


def write_hf_model(model_state: dict[str, torch.Tensor], hf_source: str, out_url: str) -> str:
    """Write an HF model directory (safetensors + config + tokenizer) from a full HF-named state dict.

    ``hf_source`` is a local directory with ``config.json`` (and tokenizer files). ``out_url`` may be any
    fsspec URL; the files are written locally first and then uploaded. The names may be those of the
    in-memory transformers model (the torch backend's) or those of the checkpoint files (the Megatron
    backend's: e.g. one tensor per MoE expert, which transformers 5 fuses in memory).
    """
    from transformers import AutoConfig

    from raygym.vision.qwen_vl import auto_model_class

    config = AutoConfig.from_pretrained(hf_source)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=torch.float32)
    model.load_state_dict(model_state, strict=False, assign=True)
    if any(p.is_meta for p in model.parameters()):
        model = _load_file_named_state(model_state, hf_source)
    model.tie_weights()  # ties only what the config declares tied (tie_word_embeddings)
    fs, root = fsspec.core.url_to_fs(out_url)
    local = is_local(fs)
    target = root if local else tempfile.mkdtemp(prefix="raygym-hf-")
    model.save_pretrained(target, safe_serialization=True)
    for name in HF_SIDE_FILES:
        src = Path(hf_source) / name
        if name != "config.json" and src.exists():
            Path(target, name).write_bytes(src.read_bytes())
    _same_mode_as_config(Path(target))
    if not local:
        fs.put(target.rstrip("/") + "/", root, recursive=True)
        return fs.unstrip_protocol(root)
    return root


def _same_mode_as_config(directory: Path) -> None:
    """Give every file of an exported model the mode of its ``config.json`` (written with the process
    umask); transformers writes ``model.safetensors`` through a private temp file (0600)."""
    mode = (directory / "config.json").stat().st_mode & 0o777
    for entry in directory.iterdir():
        if entry.is_file() and entry.stat().st_mode & 0o777 != mode:
            entry.chmod(mode)


def checkpoint_to_export(checkpoint_dir: str) -> tuple[str, int]:
    """(path, step) of the checkpoint ``raygym export`` reads: ``checkpoint_dir`` itself when it is one,
    else the newest complete ``iter_*`` under it."""
    fs, root = fsspec.core.url_to_fs(checkpoint_dir)
    manifest = read_manifest(fs, root)
    if manifest is not None:
        return checkpoint_dir, int(manifest["rollout_id"])
    info = latest_checkpoint(checkpoint_dir)
    if info is None:
        raise ConfigError(f"checkpoint_dir={checkpoint_dir!r}: no complete raygym checkpoint found there; pass an "
                          "iter_* directory or the save directory of a run")
    return info.path, info.rollout_id


def _load_file_named_state(model_state: dict[str, torch.Tensor], hf_source: str) -> Any:
    """The transformers model of ``hf_source``'s config holding ``model_state`` given under the names of HF
    checkpoint FILES: staged as a safetensors file and read back with ``from_pretrained``, which applies
    the model's own name conversions (ConfigError naming what is missing)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from raygym.vision.qwen_vl import auto_model_class

    with tempfile.TemporaryDirectory(prefix="raygym-hfstage-") as staging:
        Path(staging, "config.json").write_bytes(Path(hf_source, "config.json").read_bytes())
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(Path(staging, "model.safetensors")),
                  metadata={"format": "pt"})
        # output_loading_info=True returns (model, info); transformers' annotation says the model alone.
        auto = auto_model_class(AutoConfig.from_pretrained(staging))
        loaded: Any = auto.from_pretrained(staging, dtype=torch.float32, output_loading_info=True)
        model, info = loaded
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ConfigError(f"export: the checkpoint lacks parameters {missing[:5]}; is it a checkpoint of this model?")
    return model


def export_hf(checkpoint_dir: str, out_dir: str) -> str:
    """Export a raygym checkpoint (an ``iter_*`` directory, or a save directory: its newest complete one)
    as an HF model directory; used by ``raygym export``. Returns ``out_dir``."""
    path, _ = checkpoint_to_export(checkpoint_dir)
    if checkpoint_adapter(path) is not None:  # a LoRA run's: its adapter folded into the base model
        return export_merged(path, out_dir)
    ckpt = load_checkpoint(path, load_optimizer=False)
    fs, croot = fsspec.core.url_to_fs(path)
    with tempfile.TemporaryDirectory(prefix="raygym-hfsrc-") as src:
        hf_dir = join_url(croot, "hf")
        if not fs.exists(join_url(hf_dir, "config.json")):
            raise ConfigError(f"checkpoint_dir={path!r}: has no hf/config.json; it cannot be exported to HF")
        for entry in fs.ls(hf_dir, detail=False):
            with fs.open(entry, "rb") as f:
                Path(src, entry.rstrip("/").rsplit("/", 1)[-1]).write_bytes(f.read())
        return write_hf_model(ckpt.model_state, src, out_dir)


# ── LoRA: a checkpoint's adapter (PEFT's directory format under ``iter_N/adapter/``) ──


def checkpoint_adapter(path: str) -> str | None:
    """The URL of checkpoint ``path``'s adapter directory when it is a LoRA run's checkpoint, else None."""
    from raygym.lora import ADAPTER_CONFIG, ADAPTER_DIR

    fs, root = fsspec.core.url_to_fs(path)
    adapter = join_url(root, ADAPTER_DIR)
    if not fs.exists(join_url(adapter, ADAPTER_CONFIG)):
        return None
    return adapter if is_local(fs) else fs.unstrip_protocol(adapter)


def write_adapter_files(files: dict[str, bytes], hf_source: str, out_url: str) -> str:
    """Write an adapter's PEFT files (name -> bytes) to ``out_url`` with the tokenizer files of ``hf_source`` beside
    them (a model's ``config.json`` is left out: the directory is an adapter, which ``peft`` loads onto its base)."""
    fs, root = fsspec.core.url_to_fs(out_url)
    fs.makedirs(root, exist_ok=True)
    for name, data in files.items():
        write_bytes_atomic(fs, join_url(root, name), data)
    for name in HF_SIDE_FILES:
        src = Path(hf_source) / name
        if name not in ("config.json", "generation_config.json") and src.exists():
            write_bytes_atomic(fs, join_url(root, name), src.read_bytes())
    return root if is_local(fs) else fs.unstrip_protocol(root)


def _read_dir(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    out = {}
    for entry in fs.ls(root, detail=False):
        if fs.isfile(entry):
            with fs.open(entry, "rb") as f:
                out[entry.rstrip("/").rsplit("/", 1)[-1]] = f.read()
    return out


def export_adapter(checkpoint_dir: str, out_dir: str) -> str:
    """Export a LoRA run's checkpoint (an ``iter_*`` directory, or a save directory: its newest complete one) as
    a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, tokenizer files)."""
    path, _ = checkpoint_to_export(checkpoint_dir)
    adapter = checkpoint_adapter(path)
    if adapter is None:
        raise ConfigError(f"checkpoint_dir={path!r}: not a LoRA checkpoint (no adapter/ there); export it with "
                          "raygym export CHECKPOINT OUT")
    files = _read_dir(adapter)
    with tempfile.TemporaryDirectory(prefix="raygym-hfsrc-") as src:
        for name, data in _read_dir(join_url(path, "hf")).items():
            Path(src, name).write_bytes(data)
        return write_adapter_files(files, src, out_dir)


def adapter_base(adapter_dir: str, base: str | None = None) -> str:
    """The local base model of a PEFT adapter directory: ``base`` when given, else its ``adapter_config.json``'s
    ``base_model_name_or_path`` (ConfigError when that is no loadable HF directory)."""
    from raygym.builtin import is_builtin, resolve_model_path
    from raygym.lora import ADAPTER_CONFIG

    fs, root = fsspec.core.url_to_fs(adapter_dir)
    with fs.open(join_url(root, ADAPTER_CONFIG), "r") as f:
        named = str(json.load(f).get("base_model_name_or_path") or "")
    source = base or named
    path = resolve_model_path(source) if is_builtin(source) else source
    if not source or not Path(path, "config.json").is_file():
        raise ConfigError(f"adapter {adapter_dir!r}: its base model {source!r} is no local HF model directory here; "
                          "pass the base model's directory (--base DIR)")
    return path


def export_merged(checkpoint_dir: str, out_dir: str, base: str | None = None) -> str:
    """Export a LoRA run's checkpoint as a whole HF model: the adapter folded into its base model's weights
    (``base``: the base model directory; default: the one the adapter names)."""
    path, _ = checkpoint_to_export(checkpoint_dir)
    adapter = checkpoint_adapter(path)
    if adapter is None:
        raise ConfigError(f"checkpoint_dir={path!r}: not a LoRA checkpoint (no adapter/ there); --merged applies "
                          "to LoRA runs only")
    with tempfile.TemporaryDirectory(prefix="raygym-adapter-") as local:
        for name, data in _read_dir(adapter).items():
            Path(local, name).write_bytes(data)
        state = merge_into_base(adapter_base(local, base), local)
        with tempfile.TemporaryDirectory(prefix="raygym-hfsrc-") as src:
            for name, data in _read_dir(join_url(path, "hf")).items():
                Path(src, name).write_bytes(data)
            return write_hf_model(state, src, out_dir)


def merge_into_base(base_path: str, adapter_dir: str) -> dict[str, torch.Tensor]:
    """The HF state dict of ``base_path``'s model with the adapter of ``adapter_dir`` folded into its weights
    (W + B A * alpha / r), fp32."""
    from raygym.lora import import_peft

    peft = import_peft()
    from transformers import AutoConfig

    from raygym.vision.qwen_vl import auto_model_class

    base = auto_model_class(AutoConfig.from_pretrained(base_path)).from_pretrained(base_path, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}
