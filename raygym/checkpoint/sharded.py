"""Sharded checkpoints: every trainer rank writes its own blocks with ``torch.distributed.checkpoint``
(DCP); nothing is gathered to one rank, and a checkpoint loads on any world size (DCP reshards).

Layout of ``<dir>/iter_{rollout_id:07d}/`` (format ``raygym-checkpoint/2``):

- ``dcp/``: DCP's ``.metadata`` and one ``__<rank>_<n>.distcp`` file per rank: ``model.<HF name>`` (fp32
  weights in HF names and HF shapes, whatever the backend or its parallel layout) and, unless
  ``no_save_optim``, ``optimizer.state.<HF name>.<exp_avg|exp_avg_sq|step>`` (torch's optimizer state
  dict layout, keyed by HF name);
- ``trainer_state/rank_<r>.pt``: rank r's LR-schedule position and RNG states (a rank beyond the saved
  world takes rank 0's);
- ``extra.json`` (the caller's JSON: data position, ...), ``hf/`` (config and tokenizer files);
- a LoRA run's ``adapter/``: the adapters in PEFT's directory format (``adapter_config.json``,
  ``adapter_model.safetensors``), which ``peft`` loads onto the base model; ``dcp/`` then holds the adapters
  and their optimizer state only;
- ``manifest.json``: written LAST by rank 0, after every rank's files are complete, listing every file
  and its size (``raygym.checkpoint.store`` skips a directory without a valid one). Saved with ``commit=False``,
  it is written as ``manifest.pending.json`` and the checkpoint counts only once
  :func:`raygym.checkpoint.files.commit_manifest` puts it in place (the loop does, after the step's rows).

The rank-0 gather-and-pickle format (``raygym-checkpoint/1``, ``raygym.checkpoint.store.save_checkpoint``) still
loads. The directory must be shared by all ranks (a shared filesystem or an object store URL).

>>> import torch
>>> from raygym.checkpoint.state import CheckpointState
>>> url = save_sharded("memory://sharded-doc", 4, CheckpointState(model={"w": torch.ones(2)}), rank=0, world_size=1)
>>> template = CheckpointState(model={"w": torch.zeros(2)})
>>> load_sharded(url, template, rank=0, world_size=1).model["w"].tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import io
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import torch

from raygym.checkpoint.files import (
    FORMAT,
    MANIFEST,
    PENDING_MANIFEST,
    is_local,
    iter_dir_name,
    join_url,
    read_manifest,
    write_bytes_atomic,
    write_extra_and_hf_files,
)
from raygym.checkpoint.state import CheckpointState
from raygym.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT_SHARDED = "raygym-checkpoint/2"
DCP_DIR = "dcp"
TRAINER_STATE_DIR = "trainer_state"


def _rank_file(rank: int) -> str:
    return f"{TRAINER_STATE_DIR}/rank_{rank:05d}.pt"


@contextmanager
def _dcp_call(world_size: int) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``dcp.save`` / ``dcp.load``: one rank runs without a process group (DCP then
    warns on every call that it assumes so; that is the intent here)."""
    if world_size > 1:
        yield {}
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent", category=UserWarning)
        yield {"no_dist": True}


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def save_sharded(
    dir_url: str,
    rollout_id: int,
    state: CheckpointState,
    *,
    rank: int,
    world_size: int,
    extra: dict[str, Any] | None = None,
    hf_source: str | None = None,
    commit: bool = True,
) -> str:
    """Write checkpoint ``rollout_id`` under ``dir_url``: a collective, every rank of the trainer calls it
    with its own :class:`CheckpointState`. Returns the checkpoint's URL (on every rank). ``commit=False``
    leaves it incomplete until :func:`raygym.checkpoint.files.commit_manifest`."""
    import torch.distributed.checkpoint as dcp

    fs, root = fsspec.core.url_to_fs(dir_url)
    path = join_url(root, iter_dir_name(rollout_id))
    url = path if is_local(fs) else fs.unstrip_protocol(path)
    if rank == 0:
        if fs.exists(path):  # overwriting: no old manifest may vouch for new files, no old shard may linger
            for name in (MANIFEST, PENDING_MANIFEST):
                if fs.exists(join_url(path, name)):
                    fs.rm(join_url(path, name))
            fs.rm(path, recursive=True)
        fs.makedirs(join_url(path, TRAINER_STATE_DIR), exist_ok=True)
    _barrier(world_size)
    buf = io.BytesIO()
    torch.save({"schedule": state.schedule, "rng": state.rng}, buf)
    with fs.open(join_url(path, _rank_file(rank)), "wb") as f:
        f.write(buf.getvalue())
    tensors: dict[str, Any] = {"model": state.model}
    if state.optimizer is not None:
        tensors["optimizer"] = state.optimizer
    # DCP's last step is collective: when it returns, every rank's files and the metadata are written.
    with _dcp_call(world_size) as kwargs:
        dcp.save(tensors, checkpoint_id=join_url(url, DCP_DIR), **kwargs)
    if rank == 0:
        for rel, data in state.files.items():  # e.g. a LoRA run's adapter/ (PEFT's files), listed by the manifest
            fs.makedirs(join_url(path, *rel.split("/")[:-1]), exist_ok=True)
            with fs.open(join_url(path, rel), "wb") as f:
                f.write(data)
        _finish(fs, path, rollout_id, world_size, state.optimizer is not None, extra, hf_source,
                manifest_name=MANIFEST if commit else PENDING_MANIFEST)
    _barrier(world_size)
    return url


def _finish(
    fs: fsspec.AbstractFileSystem,
    path: str,
    rollout_id: int,
    world_size: int,
    has_optimizer: bool,
    extra: dict[str, Any] | None,
    hf_source: str | None,
    manifest_name: str = MANIFEST,
) -> None:
    write_extra_and_hf_files(fs, path, extra, hf_source)
    files = {}
    prefix = path.rstrip("/") + "/"
    for entry in fs.find(path):
        rel = entry[len(prefix):] if entry.startswith(prefix) else entry
        if rel not in (MANIFEST, PENDING_MANIFEST) and ".tmp" not in rel:
            files[rel] = int(fs.size(entry))
    manifest = {
        "format": FORMAT_SHARDED,
        "rollout_id": rollout_id,
        "world_size": world_size,
        "has_optimizer": has_optimizer,
        "files": files,
        "created": time.time(),
    }
    write_bytes_atomic(fs, join_url(path, manifest_name), json.dumps(manifest, indent=1).encode())


def checkpoint_format(path: str) -> str:
    """The manifest's format of a complete checkpoint directory (ConfigError when it is not one)."""
    fs, root = fsspec.core.url_to_fs(path)
    manifest = read_manifest(fs, root)
    if manifest is None:
        raise ConfigError(f"load={path!r}: not a complete raygym checkpoint (missing or invalid {MANIFEST})")
    return str(manifest.get("format", FORMAT))


def load_sharded(
    path: str, template: CheckpointState, *, rank: int, world_size: int, load_optimizer: bool = True
) -> CheckpointState:
    """Load checkpoint ``path`` into ``template`` in place (a collective; every rank passes its own
    template, as ``checkpoint_state`` returned it) and return it with ``schedule`` and ``rng`` filled.

    ``template.optimizer`` is loaded when ``load_optimizer`` and the checkpoint has one; otherwise it is
    set to None (a checkpoint saved with ``no_save_optim`` restores weights and schedule only)."""
    import torch.distributed.checkpoint as dcp

    fs, root = fsspec.core.url_to_fs(path)
    manifest = read_manifest(fs, root)
    if manifest is None or manifest.get("format") != FORMAT_SHARDED:
        raise ConfigError(f"load={path!r}: not a complete {FORMAT_SHARDED} checkpoint")
    if not manifest.get("has_optimizer"):
        if load_optimizer and template.optimizer is not None and rank == 0:
            log.warning("checkpoint %s has no optimizer state (saved with no_save_optim); the optimizer "
                        "starts fresh", path)
        template.optimizer = None
    elif not load_optimizer:
        template.optimizer = None
    tensors: dict[str, Any] = {"model": template.model}
    if template.optimizer is not None:
        tensors["optimizer"] = template.optimizer
    url = path if is_local(fs) else fs.unstrip_protocol(root)
    with _dcp_call(world_size) as kwargs:
        dcp.load(tensors, checkpoint_id=join_url(url, DCP_DIR), **kwargs)
    saved_rank = rank if fs.exists(join_url(root, _rank_file(rank))) else 0
    with fs.open(join_url(root, _rank_file(saved_rank)), "rb") as f:
        trainer_state = torch.load(f, map_location="cpu", weights_only=True)
    template.schedule = trainer_state["schedule"]
    template.rng = trainer_state["rng"]
    return template


def read_full_sharded(path: str, *, load_optimizer: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]]:
    """Every tensor of a sharded checkpoint, whole, in one process (what HF export needs; no process group):
    ``(model state by HF name, optimizer state or None, rank 0's trainer state)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    fs, root = fsspec.core.url_to_fs(path)
    url = path if is_local(fs) else fs.unstrip_protocol(root)
    reader = dcp.FileSystemReader(join_url(url, DCP_DIR)) if is_local(fs) else None
    metadata = reader.read_metadata() if reader is not None else _fsspec_metadata(url)
    wanted = ("model",) + (("optimizer",) if load_optimizer else ())
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        key_path = tuple(metadata.planner_data[key]) if metadata.planner_data else tuple(key.split(".", 1))
        if key_path[0] not in wanted:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            continue  # a non-tensor entry (optimizer hyperparameters); the trainer sets those itself
        flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        paths[key] = key_path
    with _dcp_call(1) as kwargs:
        dcp.load(flat, checkpoint_id=join_url(url, DCP_DIR), **kwargs)
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = paths[key]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    with fs.open(join_url(root, _rank_file(0)), "rb") as f:
        trainer_state = torch.load(f, map_location="cpu", weights_only=True)
    return nested.get("model", {}), nested.get("optimizer"), trainer_state


def _fsspec_metadata(url: str) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(join_url(url, DCP_DIR)).read_metadata()


def fill_from_full(template: Any, full: Any, on_missing: Callable[[str], None] | None = None, name: str = "") -> None:
    """Copy this rank's blocks of ``full`` (whole tensors, e.g. a ``raygym-checkpoint/1`` state) into
    ``template`` (nested dicts of plain tensors, DTensors or ``TensorShard``s) in place."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from raygym.checkpoint.tensor_shard import TensorShard

    if isinstance(template, dict):
        for key, value in template.items():
            if isinstance(full, dict) and key in full:
                fill_from_full(value, full[key], on_missing, f"{name}.{key}" if name else str(key))
            elif isinstance(value, (dict, torch.Tensor)) and on_missing is not None:
                on_missing(f"{name}.{key}" if name else str(key))
        return
    if not isinstance(template, torch.Tensor):
        return
    source = full.to(template.dtype)
    if isinstance(template, TensorShard):
        block = tuple(slice(o, o + n) for o, n in zip(template.offsets, template.local.shape, strict=True))
        template.local.copy_(source[block])
    elif isinstance(template, DTensor):
        local = template.to_local()
        shape, offsets = compute_local_shape_and_global_offset(template.shape, template.device_mesh, template.placements)
        local.copy_(source[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))])
    else:
        template.copy_(source)
