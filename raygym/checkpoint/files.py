"""What both checkpoint formats share (:mod:`raygym.checkpoint.store`, :mod:`raygym.checkpoint.sharded`): the file
names, the manifest that marks a checkpoint complete, and the writes through fsspec (atomic on local disks)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import fsspec

MANIFEST = "manifest.json"
# A checkpoint saved with its commit deferred: the manifest as it will read, not yet under its own name (a
# directory holding only this is incomplete). :func:`commit_manifest` puts it in place.
PENDING_MANIFEST = "manifest.pending.json"
FORMAT = "raygym-checkpoint/1"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
    # a vision-language model's image and processor settings (raygym/vision/qwen_vl.py)
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def iter_dir_name(rollout_id: int) -> str:
    """The directory of the checkpoint saved after step ``rollout_id``.

    >>> iter_dir_name(19)
    'iter_0000019'
    """
    return f"iter_{rollout_id:07d}"


def join_url(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or an fsspec URL.

    >>> join_url("s3://b/ckpt/", "iter_0000001", "manifest.json")
    's3://b/ckpt/iter_0000001/manifest.json'
    """
    return "/".join([base.rstrip("/"), *parts])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk (where a rename makes a write atomic)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def write_bytes_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Local disks: temp file then rename; object stores write whole objects, so a plain write."""
    if is_local(fs):
        tmp = f"{path}.tmp{os.getpid()}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def commit_manifest(checkpoint_url: str) -> bool:
    """Make the checkpoint at ``checkpoint_url`` complete: its pending manifest becomes ``manifest.json``
    (atomically on local disks). Returns False when there is nothing pending (already committed).

    The training loop saves a step's checkpoint before its weight sync, and commits it only once the step's
    rows are on disk, so a kill at any point leaves a checkpoint and its rows together or neither.

    >>> fs = fsspec.filesystem("memory")
    >>> fs.pipe("/commit-doc/iter_0000002/manifest.pending.json", b'{"rollout_id": 2, "files": {}}')
    >>> read_manifest(fs, "/commit-doc/iter_0000002") is None
    True
    >>> commit_manifest("memory:///commit-doc/iter_0000002"), read_manifest(fs, "/commit-doc/iter_0000002")
    (True, {'rollout_id': 2, 'files': {}})
    >>> commit_manifest("memory:///commit-doc/iter_0000002")
    False
    """
    fs, path = fsspec.core.url_to_fs(checkpoint_url)
    pending = join_url(path, PENDING_MANIFEST)
    if not fs.exists(pending):
        return False
    with fs.open(pending, "rb") as f:
        data = f.read()
    write_bytes_atomic(fs, join_url(path, MANIFEST), data)
    fs.rm(pending)
    return True


def write_extra_and_hf_files(fs: fsspec.AbstractFileSystem, path: str, extra: dict[str, Any] | None,
                             hf_source: str | None) -> None:
    """A checkpoint's ``extra.json`` and, from the HF directory ``hf_source``, its config and tokenizer
    files under ``hf/`` (both checkpoint formats write these the same way)."""
    with fs.open(join_url(path, "extra.json"), "w") as f:
        json.dump(extra or {}, f)
    if hf_source:
        fs.makedirs(join_url(path, "hf"), exist_ok=True)
        for name in HF_SIDE_FILES:
            src = Path(hf_source) / name
            if src.exists():
                with fs.open(join_url(path, "hf", name), "wb") as f:
                    f.write(src.read_bytes())


def read_manifest(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint at ``path`` when it is complete (every file it lists is there with its
    size), else None."""
    mpath = join_url(path, MANIFEST)
    if not fs.exists(mpath):
        return None
    try:
        with fs.open(mpath, "r") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    for rel, size in manifest.get("files", {}).items():
        full = join_url(path, rel)
        if not fs.exists(full) or int(fs.size(full)) != int(size):
            return None
    return manifest
