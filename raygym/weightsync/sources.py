"""Where ``/update_weights_from_disk`` may read weights from, and how it reads them.

An engine loads only from the sources its launcher configured (the run's sync directory, its own model
directory, ...): a request naming anything else would make the server fetch caller-chosen URLs and
replace the served model with them. Without configured prefixes only local paths are accepted. A path
that is outside the sources, missing, or holds no checkpoint gets one and the same answer, so probing
the server reveals nothing about the disk or the network.

Two layouts are read: a Hugging Face checkpoint directory (``*.safetensors``, or one such file), and a
raygym version directory (``manifest.json`` + ``DONE`` + raygym buckets), refused while ``DONE`` is absent.

>>> s = WeightSources(["/shared/sync"])
>>> s.allows("/shared/sync/v000003"), s.allows("/shared/sync/../etc"), s.allows("http://10.0.0.1/w")
(True, False, False)
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Sequence

import torch

NOT_LOADABLE = "no loadable checkpoint (it is missing, holds no .safetensors, or is outside the weight sources this server loads from)"


class WeightSourceError(ValueError):
    """``model_path`` cannot be loaded; the message never says why (see the module docstring)."""


def _normalize(url: str) -> tuple[str, str]:
    """(protocol, normalized path) of a path or URL; ``file://`` and bare paths are ``local``."""
    if "://" in url:
        protocol, _, rest = url.partition("://")
        if protocol == "file":
            return "local", posixpath.normpath("/" + rest.lstrip("/"))
        return protocol, posixpath.normpath(rest)
    return "local", posixpath.normpath(url if url.startswith("/") else posixpath.abspath(url))


class WeightSources:
    """The prefixes (paths or fsspec URLs) weights may come from; none = local paths only."""

    def __init__(self, prefixes: Sequence[str] = ()) -> None:
        self.prefixes = [_normalize(p) for p in prefixes if p]

    def allows(self, url: str) -> bool:
        protocol, path = _normalize(url)
        if not self.prefixes:
            return protocol == "local"
        return any(protocol == p and (path == root or path.startswith(root.rstrip("/") + "/"))
                   for p, root in self.prefixes)

    def read(self, url: str) -> Iterator[tuple[str, torch.Tensor]] | Iterable[tuple[str, torch.Tensor]]:
        """The tensors at ``url`` (checked before anything is read: raises :class:`WeightSourceError`)."""
        import fsspec

        from raygym.weightsync.transport_disk import DONE_FILE, MANIFEST_FILE, read_version_dir

        if not self.allows(url):
            raise WeightSourceError(f"model_path={url!r}: {NOT_LOADABLE}")
        try:
            fs, root = fsspec.core.url_to_fs(url)
            if root.endswith(".safetensors"):
                files = [root] if fs.exists(root) else []
            else:
                manifest = f"{root.rstrip('/')}/{MANIFEST_FILE}"
                if fs.exists(manifest) and fs.exists(f"{root.rstrip('/')}/{DONE_FILE}"):
                    return read_version_dir(url)
                if fs.exists(manifest):
                    raise WeightSourceError(
                        f"model_path={url!r} has {MANIFEST_FILE} but no {DONE_FILE} marker: the version is "
                        "incomplete (still being written, or its writer failed); retry once DONE exists")
                files = sorted(fs.glob(root.rstrip("/") + "/*.safetensors"))
        except WeightSourceError:
            raise
        except Exception:  # unreachable, permission denied, ...: the same answer as missing
            files = []
        if not files:
            raise WeightSourceError(f"model_path={url!r}: {NOT_LOADABLE}")
        return _read_safetensors(fs, files)


def _read_safetensors(fs: object, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load as load_bytes

    for path in files:
        yield from load_bytes(fs.cat_file(path)).items()  # type: ignore[attr-defined]
