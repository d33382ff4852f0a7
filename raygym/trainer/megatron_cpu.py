"""The Megatron backend's CPU mode: megatron-core 0.16 on a machine without CUDA (tests, laptops).

megatron-core targets CUDA. Its model code runs on a CPU torch except for a few hard-coded CUDA calls;
its DistributedDataParallel wrapper and its optimizer do not run at all. When ``torch.cuda`` is not
available, ``MegatronBackend.init`` switches to this mode (process-wide: the backend owns its process,
as every trainer rank runs in its own actor or worker process). It changes nothing in the maths:

1. ``torch.cuda.current_device()`` returns ``"cpu"``: Megatron allocates some buffers with
   ``device=torch.cuda.current_device()`` (rotary frequencies, tensor-parallel gather buffers, the
   vocabulary-parallel embedding mask); they land on the CPU.
2. "The CUDA RNG" that Megatron's RNG tracker seeds, saves and restores (``model_parallel_cuda_manual_seed``,
   ``get_cuda_rng_tracker().fork()`` around dropout and activation recomputation) is one CPU
   ``torch.Generator``: ``torch.cuda.manual_seed`` / ``torch.cuda.get_rng_state`` and Megatron's
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` read and write it.
3. The model is built and trained in float32 (``params_dtype="auto"``), and ``qkv_format="thd"`` (packed
   attention from Transformer Engine, CUDA only) runs as ``"bshd"``: Megatron's own attention over the same
   packed micro-batch with a block-diagonal causal mask (``MegatronOptions.resolved_qkv_format``).
4. Instead of Megatron's DDP and optimizer, the backend steps a torch AdamW (``raygym.trainer.optim``)
   over the model's parameters with the LR schedule of the torch backend; it sums gradients over the
   data-parallel group itself (the expert-data-parallel group for experts, the tensor-parallel group for
   sequence-parallel norms) and clips by the global norm over tensor- and expert-parallel shards.

Parallel state (TP, SP, EP, DP) runs over gloo, so a multi-rank Megatron trainer works on one machine.

>>> # MegatronBackend(settings).init()  # on a CPU-only machine: enable_cpu_mode() is called first
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_ENABLED = False


def enable_cpu_mode() -> None:
    """Apply items 1 and 2 of the module docstring in this process (idempotent; a no-op with CUDA)."""
    global _ENABLED
    if _ENABLED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as megatron_random

    generator = torch.Generator()

    def current_device() -> str:
        return "cpu"

    def get_rng_state(device: object = "cuda") -> torch.Tensor:
        return generator.get_state()

    def manual_seed(seed: int) -> None:
        generator.manual_seed(int(seed))

    def get_tracker_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return generator.get_state()

    def set_tracker_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
        generator.set_state(new_state)

    torch.cuda.current_device = current_device  # type: ignore[assignment]  # "cpu" where torch says int
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.manual_seed = manual_seed
    megatron_random._get_cuda_rng_state = get_tracker_state
    megatron_random._set_cuda_rng_state = set_tracker_state
    _ENABLED = True
    log.info("megatron backend: CPU mode (fp32, Megatron's own attention, torch AdamW; see raygym.trainer.megatron_cpu)")
