"""One wrong tensor after a sync, for the verification tests of every engine kind: either the engine ends up
holding it (:class:`TamperingLink` loads it over the sync, just before the coordinator verifies), or the
trainer sends it while its own model holds the right one (:class:`FaultyTrainer`: only a probe that compares
with the trainer's forward pass can see that)."""

from __future__ import annotations

from typing import Any

import torch

from raygym.engine_protocol import Endpoint, UpdateWeightsFromTensor
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
    (``stale``, recorded by :meth:`arm`) or the current one times 1.01 (``scaled``)."""

    def __init__(self, model_path: str, lr: float = 1e-3):
        super().__init__(model_path, lr=lr)
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
        return self._stale if fault == "stale" else current * SCALE

    def hf_weights(self):
        for name, t in super().hf_weights():
            if self.fault is not None and name == self.fault[0]:
                t = self.wrong(name, t, self.fault[1])
            yield name, t


class TamperingLink(HttpEngineLink):
    """The real HTTP link; while armed, just before the coordinator verifies a sync it loads one tensor of the
    trainer's, wrong, into the engine through ``/update_weights_from_tensor`` (inline CPU tensors, which raygym's
    server, vLLM's adapter and stock SGLang all read)."""

    def __init__(self, url: str, trainer: FaultyTrainer, dtype: torch.dtype = torch.float32):
        super().__init__(url, "engine0")
        self.trainer, self.dtype = trainer, dtype
        self.armed: tuple[str, str] | None = None
        self.tampered = 0

    def call(self, endpoint: Endpoint, body: Any, timeout: float) -> Any:
        if self.armed is not None and endpoint in (Endpoint.RAYGYM_WEIGHTS_CHECKSUM, Endpoint.MODEL_INFO):
            name, fault = self.armed
            current = dict(LocalTrainer.hf_weights(self.trainer))[name]
            tensor = self.trainer.wrong(name, current, fault).to(self.dtype)
            answer = super().call(Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, UpdateWeightsFromTensor(
                serialized_named_tensors=[dumps_named_tensors([(name, tensor)])]), timeout)
            assert answer["success"], answer
            self.tampered += 1
        return super().call(endpoint, body, timeout)


def syncs_without_false_alarm(sync: WeightSync, trainer: LocalTrainer, first: int, count: int) -> list[dict[str, float]]:
    """``count`` syncs (versions ``first`` ...), a training step before each: every one must verify at once."""
    history = []
    for version in range(first, first + count):
        trainer.train_step()
        metrics = sync.push(version)
        assert metrics["sync/resynced"] == 0.0, (version, metrics)
        history.append(metrics)
    return history
