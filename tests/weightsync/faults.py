"""One wrong tensor after a sync, for the verification tests of every engine kind: either the engine ends up
holding it (:class:`TamperingLink` loads it over the sync, just before the coordinator verifies), or the
trainer sends it while its own model holds the right one (:class:`FaultyTrainer`: only a probe that compares
with the trainer's forward pass can see that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raygym.engine_api.protocol import Endpoint, UpdateWeightsFromTensor
from raygym.weightsync.coordinator import WeightSync
from raygym.weightsync.engine_link import HttpEngineLink
from raygym.weightsync.tensor_pickle import dumps_named_tensors
from tests.weightsync.local_trainer import LocalTrainer

MLP_TENSOR = "model.layers.1.mlp.up_proj.weight"  # the builtin tiny Qwen3 has two layers
ATTENTION_TENSOR = "model.layers.1.self_attn.v_proj.weight"
FAULTS = ("stale", "scaled")
SCALE = 1.01


class FaultyTrainer(LocalTrainer):
    """A LocalTrainer whose pushes, while ``fault`` is set, carry one tensor wrong: the previous version's
    (``stale``, recorded by :meth:`arm`) or the current one times ``scale`` (``scaled``)."""

    def __init__(self, model_path: str, lr: float = 1e-3, scale: float = SCALE):
        super().__init__(model_path, lr=lr)
        self.scale = scale
        self.fault: tuple[str, str] | None = None
        self._stale: torch.Tensor | None = None

    def arm(self, name: str, fault: str) -> None:
        """Take one training step; the next pushes send ``name`` wrong (``fault``) until :meth:`disarm`."""
        self._stale = dict(super().hf_weights())[name].clone()
        self.train_step()
        self.fault = (name, fault)

    def disarm(self) -> None:
        self.fault = None

    def wrong(self, name: str, current: torch.Tensor, fault: str) -> torch.Tensor:
        assert self._stale is not None
        return self._stale if fault == "stale" else current * self.scale

    def hf_weights(self):
        for name, t in super().hf_weights():
            if self.fault is not None and name == self.fault[0]:
                if self.fault[1] == "omitted":  # left out of the push: the engine keeps what it had
                    continue
                t = self.wrong(name, t, self.fault[1])
            yield name, t


class TamperingLink(HttpEngineLink):
    """The real HTTP link; while armed, the engine loads one tensor of the trainer's wrong. Over the disk
    transport the tensor is rewritten in the version directory just before the engine reads it (vLLM's adapter
    loads a layer once per update session); otherwise it is loaded through ``/update_weights_from_tensor``
    (inline CPU tensors) just before the coordinator verifies the sync (raygym's server)."""

    def __init__(self, url: str, trainer: FaultyTrainer, dtype: torch.dtype = torch.float32, disk: bool = False):
        super().__init__(url, "engine0")
        self.trainer, self.dtype, self.disk = trainer, dtype, disk
        self.armed: tuple[str, str] | None = None
        self.tampered = 0

    def wrong_tensor(self) -> tuple[str, torch.Tensor]:
        assert self.armed is not None
        name, fault = self.armed
        current = dict(LocalTrainer.hf_weights(self.trainer))[name]
        return name, self.trainer.wrong(name, current, fault)

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        if self.armed is not None and endpoint is Endpoint.UPDATE_WEIGHTS_FROM_DISK:
            self.tampered += rewrite(body.model_path, *self.wrong_tensor())
        elif self.armed is not None and endpoint in (Endpoint.RAYGYM_WEIGHTS_CHECKSUM, Endpoint.MODEL_INFO) \
                and not self.disk:
            name, tensor = self.wrong_tensor()
            answer = super().call(Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, UpdateWeightsFromTensor(
                serialized_named_tensors=[dumps_named_tensors([(name, tensor.to(self.dtype))])]), timeout)
            assert answer["success"], answer
            self.tampered += 1
        return super().call(endpoint, body, timeout)


def rewrite(directory: str, name: str, tensor: torch.Tensor) -> int:
    """Replace tensor ``name`` in the safetensors shard of ``directory`` that holds it (in that shard's dtype)."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors = load_file(str(shard))
        if name in tensors:
            tensors[name] = tensor.to(tensors[name].dtype).contiguous()
            save_file(tensors, str(shard))
            return 1
    raise AssertionError(f"no shard of {directory} holds {name}")


def syncs_without_false_alarm(sync: WeightSync, trainer: LocalTrainer, first: int, count: int) -> list[dict[str, float]]:
    """``count`` syncs (versions ``first`` ...), a training step before each: every one must verify at once."""
    history = []
    for version in range(first, first + count):
        trainer.train_step()
        metrics = sync.push(version)
        assert metrics["sync/resynced"] == 0.0, (version, metrics)
        history.append(metrics)
    return history


EXPERT = 3
EXPERTS_TENSOR = "model.layers.1.mlp.experts.down_proj"  # transformers 5's fused in-memory name: [experts, ...]


class OneExpertWrong(FaultyTrainer):
    """Sends expert 3's down_proj of layer 1 wrong (one step stale, or scaled by 1.01); the rest is right."""

    def wrong(self, name, current, fault):
        whole = super().wrong(name, current, fault)
        out = current.clone()
        out[EXPERT] = whole[EXPERT]
        return out


def syncs_for(sync: WeightSync, trainer: LocalTrainer, seconds: float) -> list[dict[str, float]]:
    """A first sync, then as many more as fit in ``seconds`` (a training step before each): none may fail."""
    import time

    start, history = time.monotonic(), []
    sync.push(1)
    version = 1
    while time.monotonic() - start < seconds:
        version += 1
        history += syncs_without_false_alarm(sync, trainer, version, 1)
    return history


def assert_one_wrong_expert_fails(sync: WeightSync, trainer: OneExpertWrong, fault: str, engine: str) -> None:
    """Honest syncs pass, one expert sent wrong (``fault``) fails the calibrated probe, and the next honest sync
    passes without a resync."""
    import pytest

    from raygym.errors import WeightSyncError

    first = sync.push(1)
    history = syncs_without_false_alarm(sync, trainer, 2, 2)
    print(f"{engine} MoE float32: floor {first['sync/probe_floor_mean']:.2e} / {first['sync/probe_floor_max']:.2e}, "
          f"worst margin {max(m['sync/probe_margin'] for m in history):.2f}")
    trainer.arm(EXPERTS_TENSOR, fault)
    with pytest.raises(WeightSyncError, match="probe log-probs differ") as failed:
        sync.push(4)
    print(failed.value)
    trainer.disarm()
    assert sync.push(5)["sync/resynced"] == 0.0
