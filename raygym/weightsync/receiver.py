"""Engine side of weight sync, independent of any web framework: what an inference server does on
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/update_weights_from_disk``,
``/destroy_weights_update_group`` and ``/raygym/weights_checksum`` for a model it holds.

raygym's server can delegate those endpoints here; tests and benchmarks run it in plain processes or
Ray actors as a receiver that does not generate (so pause/continue/flush are trivially successful).

>>> r = WeightReceiver(model)                                   # doctest: +SKIP
>>> r.update_weights_from_disk(model_path="/shared/v000003", load_format=LOADER, weight_version="3")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raygym.weightsync import loader
from raygym.weightsync.codec import dtype_from_name
from raygym.weightsync.payload import LOADER
from raygym.weightsync.transport_disk import read_version_dir
from raygym.weightsync.transport_dist import ScratchBuffers, join_group, receive_tensors

Loader = Callable[[torch.nn.Module, Iterable[tuple[str, torch.Tensor]]], Any]


def resolve_loader(load_format: str | None, allowed: Iterable[str] = (LOADER,)) -> Loader:
    """The loader named by ``load_format`` (``pkg.mod:fn`` or ``pkg.mod.fn``); None/"auto" = copy by HF name."""
    if load_format in (None, "", "auto"):
        return loader.load_payload
    if _dotted(load_format) not in {_dotted(a) for a in allowed}:
        raise ValueError(f"load_format={load_format!r} is not a registered custom weight loader {sorted(allowed)}")
    module, _, fn = _dotted(load_format).rpartition(".")
    return getattr(importlib.import_module(module), fn)


def _dotted(path: str) -> str:
    return path.replace(":", ".")


class WeightReceiver:
    """Receives weights into ``model`` (on ``device``) and reports checksums by HF name."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu", weight_version: str = "0",
                 custom_loaders: Iterable[str] = (LOADER,), timeout_s: float = 600.0):
        self.model = model
        self.device = torch.device(device)
        self.weight_version = weight_version
        self.custom_loaders = tuple(custom_loaders)
        self.timeout_s = timeout_s
        self.groups: dict[str, Any] = {}
        self.last_apply_s = 0.0
        self._scratch = ScratchBuffers()  # requests are handled one at a time

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo") -> dict[str, Any]:
        try:
            self.groups[group_name] = join_group(master_address, master_port, rank_offset, world_size, group_name,
                                                 backend, self.timeout_s)
        except Exception as exc:
            return {"success": False, "message": f"failed to join {group_name}: {exc}"}
        return {"success": True, "message": f"joined {group_name} as rank {rank_offset}"}

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        found = self.groups.pop(group_name, None) is not None
        return {"success": found, "message": "destroyed" if found else f"no group {group_name}"}

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None) -> dict[str, Any]:
        pg = self.groups.get(group_name)
        if pg is None:
            return {"success": False, "message": f"group {group_name} is not initialized"}
        try:
            specs = [(n, dtype_from_name(d), list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
            # receive everything first (the sender's broadcasts must all complete), then load
            received = list(receive_tensors(pg, specs, self.device, self.timeout_s, self._scratch))
            return self._load(received, load_format, weight_version)
        except Exception as exc:
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None) -> dict[str, Any]:
        try:
            return self._load(read_version_dir(model_path), load_format, weight_version)
        except Exception as exc:
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}

    def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "checksums": loader.model_checksums(self.model, names)}

    # A receiver does not generate: these endpoints exist so a coordinator can drive it like an engine.
    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return {"success": True}

    def continue_generation(self) -> dict[str, Any]:
        return {"success": True}

    def flush_cache(self) -> dict[str, Any]:
        return {"success": True}

    def abort_request(self, abort_all: bool = True) -> dict[str, Any]:
        return {"success": True}

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], load_format: str | None,
              weight_version: str | None) -> dict[str, Any]:
        fn = resolve_loader(load_format, self.custom_loaders)
        start = time.perf_counter()
        with torch.no_grad():
            fn(self.model, named_tensors)
        self.last_apply_s = time.perf_counter() - start
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return {"success": True, "message": "ok", "apply_s": self.last_apply_s}
