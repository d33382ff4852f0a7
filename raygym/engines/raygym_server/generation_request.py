"""The records of raygym's generation engine (:mod:`raygym.engines.raygym_server.generation`): one request, the engine's
counters, its errors, and the host-memory trim it runs when idle."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from raygym.engines.raygym_server.sampling import SamplingParams
from raygym.engines.raygym_server.vision_inputs import ImageInputs


def release_host_memory() -> None:
    """Collect garbage and give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere),
    so the memory of a large aborted workload does not stay with the server."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (memory released, or stopped)."""


class EngineBusy(EngineUnavailable):
    """The pending queue is full (``max_queued_requests``): try again later (HTTP 503)."""


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate. Filled in by the engine; ``on_done`` (and ``on_token``, when set) are called from
    its thread.

    ``finish_reason`` follows SGLang: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": token_id | str}`` or ``{"type": "abort", "message": str}``.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[GenerationRequest], None] | None = None
    on_token: Callable[[GenerationRequest], None] | None = None  # after each decode step that added a token
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)  # the weight version that produced each token
    images: ImageInputs | None = None  # a vision-language model's prompt images (GenerationEngine.prepare_images)
    return_routed_experts: bool = False  # keep the experts its MoE routers chose (raygym/engines/raygym_server/routing_capture.py)
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] chunks, in order
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _failures: int = field(default=0, repr=False)  # decode steps this request was part of that failed
    _abort_message: str | None = field(default=None, repr=False)
    _generator: torch.Generator | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


@dataclass
class EngineStats:
    """Counters the server exposes so tests and operators can see batching at work."""

    batches: int = 0
    requests_finished: int = 0
    generated_tokens: int = 0
    max_batch_size: int = 0
    joined: int = 0  # requests that joined a running batch (continuous batching)
    recomputed: int = 0  # running requests whose KV cache was recomputed after the weights changed under them
    parks: int = 0  # times the worker stopped to wait (no work, a pause, a hold): it decodes nothing then
    recent_batch_sizes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    parked: bool = False  # the worker is waiting right now

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests_finished": self.requests_finished,
            "generated_tokens": self.generated_tokens,
            "max_batch_size": self.max_batch_size,
            "joined": self.joined,
            "recomputed": self.recomputed,
            "parks": self.parks,
            "parked": self.parked,
            "recent_batch_sizes": list(self.recent_batch_sizes),
        }
