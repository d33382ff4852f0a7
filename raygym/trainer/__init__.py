"""Trainers: ``TrainerActor`` over a ``TrainerBackend`` (torch/FSDP2 or Megatron), ``TrainBatch``.

Importing this package is light; torch models load in ``TrainerActor.init()``.
"""

from raygym.trainer.actor import TrainerActor, choose_backend
from raygym.trainer.backend import TrainerBackend, TrainerSettings
from raygym.trainer.batch import TrainBatch

__all__ = ["TrainBatch", "TrainerActor", "TrainerBackend", "TrainerSettings", "choose_backend"]
