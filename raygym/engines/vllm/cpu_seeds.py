"""Seeded requests on vLLM's CPU build survive a split prefill. Runs in vLLM's worker processes.

When a prompt's prefill is split over several steps (chunked prefill: the step's token budget is spent), vLLM
samples a token for the partial request anyway and discards it, rewinding the request's seeded generator with
``gen.set_offset(gen.get_offset() - 4)`` (``GPUModelRunner._bookkeeping_sync``). Only CUDA's Philox generators
have an offset: on CPU it raises "CPU Generator does not use offset" and the worker dies, so every fully
asynchronous run on vLLM's CPU build that continues many requests at once (raygym seeds every request) lost its
engine at each weight sync. Here the CPU generators of those partial requests are rewound exactly instead: their
state is kept before the step samples and put back where vLLM would move the offset, so a seeded sample does not
depend on how its prefill was split.
"""

from __future__ import annotations

import functools
from typing import Any

_PATCHED = "_raygym_cpu_rewind"
_SAVED = "_raygym_cpu_generator_states"


def _discarded_cpu_generators(runner: Any) -> dict[int, tuple[Any, Any]]:
    """Row -> (generator, its state now) for the rows whose sampled token this step discards."""
    import numpy as np

    num_reqs = runner.input_batch.num_reqs
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    saved: dict[int, tuple[Any, Any]] = {}
    for row in rows:
        gen = runner.input_batch.generators.get(int(row))
        if gen is not None and gen.device.type == "cpu":
            saved[int(row)] = (gen, gen.get_state())
    return saved


def rewind_cpu_generators_exactly() -> bool:
    """Patch vLLM's model runner as described above; False when this vLLM has no such methods (another release:
    its own rewind is left alone)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    sample, bookkeeping = (getattr(GPUModelRunner, name, None) for name in ("sample_tokens", "_bookkeeping_sync"))
    if sample is None or bookkeeping is None:
        return False
    if getattr(GPUModelRunner, _PATCHED, False):
        return True

    @functools.wraps(sample)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _SAVED, _discarded_cpu_generators(self))
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved: dict[int, tuple[Any, Any]] = getattr(self, _SAVED, None) or {}
        generators = self.input_batch.generators
        for row in saved:  # vLLM's own rewind skips them: it would raise on a CPU generator
            generators.pop(row, None)
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for row, (gen, state) in saved.items():
                gen.set_state(state)  # as if the discarded token had not been sampled
                generators[row] = gen
            setattr(self, _SAVED, {})

    GPUModelRunner.sample_tokens = sample_tokens
    GPUModelRunner._bookkeeping_sync = bookkeeping_sync
    setattr(GPUModelRunner, _PATCHED, True)
    return True


def rewind_cpu_generators_on_cpu() -> bool:
    """:func:`rewind_cpu_generators_exactly` on vLLM's CPU platform only (CUDA's generators rewind by offset)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return rewind_cpu_generators_exactly() if current_platform.is_cpu() else False
