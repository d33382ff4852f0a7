"""Adapter-only weight sync to engines that load LoRA adapters by endpoint (stock SGLang, raygym's vLLM adapter).

Such an engine serves a base model plus adapters it loads from PEFT directories: ``/load_lora_adapter``
{``lora_name``, ``lora_path``} and ``/unload_lora_adapter`` {``lora_name``} (SGLang's routes and fields; a
request picks an adapter with ``lora_path`` = its name). :class:`AdapterTransport` is the sender's transport for
them: the buckets of one version (HF-named full tensors: the adapters' A and B matrices) are collected, written
as one PEFT directory under ``<directory>/v{version:06d}`` (a few MB: ``adapter_config.json`` +
``adapter_model.safetensors``), and every engine (re)loads it under :data:`raygym.lora.ADAPTER_NAME` and labels
its weight version. Engines whose capabilities say ``lora_replace`` swap the adapter in one call (no moment
without it); the others unload it first. The directory of the previous version is removed once every engine
loaded the new one. The directory must be a path every engine can read (one machine, or a shared filesystem).

Verification is the coordinator's usual one for the kind: the probe, whose requests name the adapter.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from raygym.engine_api.kinds import capabilities
from raygym.engine_api.protocol import Endpoint, LoadLoRAAdapter, UnloadLoRAAdapter, UpdateWeightVersion
from raygym.errors import ConfigError, WeightSyncError
from raygym.lora import ADAPTER_NAME, write_adapter
from raygym.weightsync.codec import dtype_from_name
from raygym.weightsync.engine_link import EngineLink, checked
from raygym.weightsync.payload import FULL, Manifest


def adapter_version_dir(directory: str, version: int) -> str:
    """Where version ``version`` of the adapter is written.

    >>> adapter_version_dir("/shared/adapters", 7)
    '/shared/adapters/v000007'
    """
    return f"{directory.rstrip('/')}/v{version:06d}"


class AdapterTransport:
    """Sender side of adapter-only sync to ``lora_endpoints`` engines (see the module docstring).

    ``config``: the PEFT ``adapter_config.json`` every version is written with; ``engine_kind``: what the engines
    are (whether they replace an adapter in place)."""

    kind = "adapter"

    def __init__(self, engines: list[EngineLink], *, directory: str, config: dict[str, Any], engine_kind: str,
                 timeout_s: float = 600.0) -> None:
        if not directory or ("://" in directory and not directory.startswith("file://")):
            raise ConfigError(
                f"update_weight_disk_dir={directory!r}: engines load LoRA adapters from a local path; set "
                "--update-weight-disk-dir to a directory every engine can read (one machine, or a shared filesystem)")
        self.engines = list(engines)
        self.directory = directory.removeprefix("file://")
        self.config = dict(config)
        self.replace = capabilities(engine_kind).lora_replace
        self.timeout_s = float(timeout_s)
        self._tensors: dict[str, torch.Tensor] = {}
        self._served: str | None = None  # the version directory the engines serve now

    @property
    def connected(self) -> bool:
        return True

    def connect(self) -> None:
        Path(self.directory).mkdir(parents=True, exist_ok=True)

    def close_group(self) -> None:
        """No connection state to drop (a restarted engine gets the adapter with the next version)."""

    def begin(self, version: int) -> None:
        self._tensors = {}

    def announce(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        """Nothing is sent before the whole adapter is written."""

    def send_bucket(self, version: int, manifest: torch.Tensor, flat: torch.Tensor) -> None:
        m = Manifest.from_bytes(manifest)
        data = flat.detach().cpu()
        for entry in m.entries:
            if entry.encoding != FULL:
                raise WeightSyncError(f"adapter {entry.name!r}: engines load adapters whole; a {entry.encoding} "
                                      "payload cannot be written as a PEFT adapter (use update_weight_mode full)")
            raw = data[entry.offset : entry.offset + entry.nbytes]
            self._tensors[entry.name] = raw.view(dtype_from_name(entry.dtype)).reshape(entry.shape).clone()

    def finish(self, version: int) -> None:
        """Write the version's adapter directory, have every engine load it and label its weight version."""
        if not self._tensors:
            raise WeightSyncError(f"version {version}: no adapter tensor was sent (is the trainer training LoRA?)")
        path = write_adapter(adapter_version_dir(self.directory, version), self.config, self._tensors)
        self._tensors = {}
        for link in self.engines:
            if not self.replace:
                try:
                    checked(link, Endpoint.UNLOAD_LORA_ADAPTER, UnloadLoRAAdapter(lora_name=ADAPTER_NAME),
                            self.timeout_s)
                except WeightSyncError:
                    pass  # not loaded yet (the first version, or a restarted engine)
            checked(link, Endpoint.LOAD_LORA_ADAPTER, LoadLoRAAdapter(lora_name=ADAPTER_NAME, lora_path=path),
                    self.timeout_s)
            checked(link, Endpoint.UPDATE_WEIGHT_VERSION,
                    UpdateWeightVersion(new_version=str(version), abort_all_requests=False), self.timeout_s)
        if self._served is not None and self._served != path:
            shutil.rmtree(self._served, ignore_errors=True)
        self._served = path

    def close(self) -> None:
        self._tensors = {}
