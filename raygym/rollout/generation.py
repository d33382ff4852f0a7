"""Batched generation for raygym's built-in inference server: pure torch, no HTTP.

A :class:`GenerationEngine` owns one Hugging Face causal LM and a worker thread. Callers
:meth:`~GenerationEngine.submit` :class:`GenerationRequest` objects from any thread; the worker
drains the queue into one batch (up to ``max_running_requests`` rows), prefills it with left
padding (attention mask + position ids), then decodes step by step with a KV cache. Each row has
its own sampling parameters and stop conditions; finished rows leave the batch (their KV cache
rows are dropped); requests that arrive meanwhile are prefilled and join the running batch
between decode steps (continuous batching). Abort and pause are checked
between decode steps, so they take effect while a batch is running.

Log-probabilities: for every sampled token we report ``log_softmax(logits / temperature)`` at
that token (plain ``log_softmax(logits)`` when temperature is 0). Top-p / top-k filtering only
shapes the sampling distribution, it is NOT applied to the reported log-probs. This is what the
trainer reproduces: it divides its own logits by ``rollout_temperature`` and takes log_softmax.

>>> from raygym.builtin import build_tiny_model
>>> model, tok = build_tiny_model(0)
>>> engine = GenerationEngine(model, eos_token_ids=[tok.eos_token_id])
>>> engine.start()
>>> req = GenerationRequest(rid="a", input_ids=tok.encode("next:3="),
...                         params=SamplingParams(temperature=0.0, max_new_tokens=4))
>>> engine.submit(req); req.wait(30)
True
>>> len(req.output_ids) <= 4 and req.finish_reason["type"] in ("stop", "length")
True
>>> engine.stop()
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raygym.rollout.protocol import PAUSE_MODES


class EngineUnavailable(RuntimeError):
    """The engine cannot take requests now (memory released, or stopped)."""


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang's ``sampling_params`` subset).

    ``temperature`` 0 means greedy; ``top_k`` -1 (or 0) means no top-k; ``max_new_tokens`` counts
    generated tokens. ``stop`` strings need a tokenizer on the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted (slime always sends false); decoding ignores it
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Validate a JSON ``sampling_params`` dict; raises ``ValueError`` naming the bad field.

        Unknown keys that SGLang accepts but raygym ignores (e.g. ``min_p``,
        ``frequency_penalty`` at their neutral values) are tolerated; anything else is an error.
        """
        raw = dict(raw or {})
        p = cls()
        for key, value in raw.items():
            if value is None:
                continue
            if key in ("temperature", "top_p"):
                setattr(p, key, _number(key, value))
            elif key in ("top_k", "max_new_tokens", "n", "sampling_seed"):
                setattr(p, key, _integer(key, value))
            elif key in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
                if not isinstance(value, bool):
                    raise ValueError(f"sampling_params.{key}={value!r}: must be true or false")
                setattr(p, key, value)
            elif key == "stop_token_ids":
                p.stop_token_ids = [_integer(key, v) for v in _as_list(key, value)]
            elif key == "stop":
                items = [value] if isinstance(value, str) else _as_list(key, value)
                if not all(isinstance(s, str) and s for s in items):
                    raise ValueError(
                        f"sampling_params.stop={value!r}: must be a non-empty string or list of them"
                    )
                p.stop = list(items)
            elif key in _IGNORED_KEYS:
                continue
            elif key in _NEUTRAL_KEYS:
                if value != _NEUTRAL_KEYS[key]:
                    raise ValueError(
                        f"sampling_params.{key}={value!r}: not supported by raygym's server; "
                        f"leave it at {_NEUTRAL_KEYS[key]!r} or use the sglang backend"
                    )
            else:
                raise ValueError(f"sampling_params.{key}: unknown field; supported: {sorted(_KNOWN_KEYS)}")
        p.validate()
        return p

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"sampling_params.top_k={self.top_k}: must be -1 (off) or >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.n < 1:
            raise ValueError(f"sampling_params.n={self.n}: must be >= 1")


_NEUTRAL_KEYS: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": {},
    "stop_regex": [],
}
# Accepted at any value: they only shape how output is streamed, never what is generated.
_IGNORED_KEYS = ("stream_interval",)
_KNOWN_KEYS = set(SamplingParams.__dataclass_fields__) | set(_NEUTRAL_KEYS) | set(_IGNORED_KEYS)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{key}={value!r}: must be a number")
    return float(value)


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key}={value!r}: must be an integer")
    return value


def _as_list(key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"sampling_params.{key}={value!r}: must be a list")
    return value


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate. Filled in by the engine; ``on_done`` is called from its thread.

    ``finish_reason`` follows SGLang: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": token_id | str}`` or ``{"type": "abort", "message": str}``.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[GenerationRequest], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
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
    recent_batch_sizes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests_finished": self.requests_finished,
            "generated_tokens": self.generated_tokens,
            "max_batch_size": self.max_batch_size,
            "joined": self.joined,
            "recent_batch_sizes": list(self.recent_batch_sizes),
        }


class GenerationEngine:
    """A request queue feeding batched KV-cached generation on one HF causal LM.

    Thread model: one worker thread runs every forward pass while holding ``model_lock``;
    :meth:`exclusive` lets another thread (weight updates, memory moves) take the model between
    decode steps. ``batch_wait_s`` is how long the worker lingers after the first queued request
    so that concurrent arrivals share a batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        max_running_requests: int = 64,
        seed: int = 0,
        batch_wait_s: float = 0.003,
        pad_token_id: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.max_running_requests = max_running_requests
        self.batch_wait_s = batch_wait_s
        self.pad_token_id = pad_token_id
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``; accept both.
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.model_lock = threading.RLock()
        self.stats = EngineStats()
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._running: list[GenerationRequest] = []
        self._paused_mode: str | None = None
        self._holds = 0
        self._released = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ----- lifecycle -----
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="raygym-generation", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._finish_all(self._drain_queue(), "engine stopped")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----- requests -----
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (thread-safe). Raises :class:`EngineUnavailable` while memory is released."""
        with self._cond:
            if self._stopping:
                raise EngineUnavailable("the generation engine is stopped")
            if self._released:
                raise EngineUnavailable(
                    "memory is released (/release_memory_occupation); call /resume_memory_occupation first"
                )
            if request.params.sampling_seed is not None:
                seed = request.params.sampling_seed
            else:
                seed = self._rng.getrandbits(63)
            request._generator = torch.Generator(device=self.device).manual_seed(seed)
            self._queue.append(request)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request by rid (or every request); returns how many were aborted."""
        with self._cond:
            hit = [r for r in (*self._queue, *self._running) if abort_all or r.rid == rid]
            for r in hit:
                r._abort_message = message
            queued = [r for r in self._queue if r._abort_message is not None]
            self._queue = collections.deque(r for r in self._queue if r._abort_message is None)
            self._cond.notify_all()
        self._finish_all(queued, message)
        return len(hit)

    def pending(self) -> int:
        """Requests queued or running."""
        with self._cond:
            return len(self._queue) + len(self._running)

    # ----- pause / continue -----
    def pause(self, mode: str = "abort") -> None:
        """Stop generating. ``abort``: in-flight requests finish as aborted. ``in_place``: the
        running batch halts between decode steps and keeps its KV cache. ``retract``: running
        requests go back to the queue (their tokens so far are kept and re-prefilled later).
        Requests that arrive while paused wait in the queue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r}: must be one of {list(PAUSE_MODES)}")
        with self._cond:
            self._paused_mode = mode
            self._cond.notify_all()
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by /pause_generation")
            self.wait_idle()

    def resume(self) -> None:
        with self._cond:
            self._paused_mode = None
            self._cond.notify_all()

    @property
    def paused(self) -> str | None:
        return self._paused_mode

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no batch is running (queued requests may remain)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @contextlib.contextmanager
    def exclusive(self, *, wait_idle: bool) -> Iterator[None]:
        """Hold the model for a weight update or a memory move.

        With ``wait_idle`` no new batch starts and running requests finish first (SGLang's
        behaviour when generation is not paused); without it the model is taken between two
        decode steps of the running batch.
        """
        with self._cond:
            self._holds += 1
        try:
            if wait_idle:
                self.wait_idle()
            with self.model_lock:
                yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def score(self, input_ids: list[int]) -> list[float]:
        """``log_softmax(logits)`` of each token of ``input_ids`` given the ones before it (from the second
        token on; raw logits, as SGLang's ``input_token_logprobs``). Runs between decode steps."""
        if len(input_ids) < 2:
            return []
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        with self.model_lock, torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()

    def set_released(self, released: bool) -> None:
        with self._cond:
            self._released = released
            self._cond.notify_all()

    @property
    def released(self) -> bool:
        return self._released

    # ----- worker -----
    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            except Exception as exc:  # a model error must not kill the worker silently
                self._finish_all(batch, f"generation failed: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._running = []
                    self._cond.notify_all()

    def _can_start(self) -> bool:
        return bool(self._queue) and self._paused_mode is None and self._holds == 0 and not self._released

    def _next_batch(self) -> list[GenerationRequest] | None:
        with self._cond:
            while not self._stopping and not self._can_start():
                self._cond.wait()
            if self._stopping:
                return None
            if self.batch_wait_s > 0 and len(self._queue) < self.max_running_requests:
                deadline = time.monotonic() + self.batch_wait_s
                while len(self._queue) < self.max_running_requests and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if not self._can_start():
                    return [] if not self._stopping else None
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_running_requests))]
            self._running = list(batch)
            return batch

    def _run_batch(self, rows: list[GenerationRequest]) -> None:
        rows = [r for r in rows if not self._finished_before_prefill(r)]
        if not rows:
            return
        self.stats.batches += 1
        self.stats.recent_batch_sizes.append(len(rows))
        cache = new_kv_cache()
        input_ids, mask, positions = self._prefill_inputs(rows)
        with self.model_lock, torch.inference_mode():
            logits = self._forward(input_ids, mask, positions, cache)
        while rows:
            rows, logits, mask, positions = self._join_waiting(rows, logits, mask, positions, cache)
            self.stats.max_batch_size = max(self.stats.max_batch_size, len(rows))
            with self.model_lock, torch.inference_mode():
                tokens, logprobs = sample_next_tokens(
                    logits, [r.params for r in rows], [r._generator for r in rows]
                )
            keep = self._advance(rows, tokens.tolist(), logprobs.tolist())
            keep = self._apply_control(rows, keep)
            if not keep:
                return
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=mask.device)
                cache.batch_select_indices(index)
                mask, positions, tokens = mask[index], positions[index], tokens[index]
                rows = [rows[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            positions = positions[:, -1:] + 1
            with self.model_lock, torch.inference_mode():
                logits = self._forward(tokens[:, None], mask, positions, cache)

    def _prefill_inputs(
        self, rows: list[GenerationRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids, attention mask and position ids [B, T] for prompt + tokens so far."""
        seqs = [r.input_ids + r.output_ids for r in rows]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _join_waiting(self, rows, logits, mask, positions, cache):
        """Continuous batching: prefill queued requests and merge them into the running batch.

        The two KV caches are left-padded to the same length (padding masked out) and stacked
        along the batch; per-row position ids make the padding invisible to the model.
        """
        room = self.max_running_requests - len(rows)
        if room <= 0 or not _mergeable(cache):
            return rows, logits, mask, positions
        with self._cond:
            if not self._can_start():
                return rows, logits, mask, positions
            new = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            self._running.extend(new)
        new = [r for r in new if not self._finished_before_prefill(r)]
        if not new:
            return rows, logits, mask, positions
        new_cache = new_kv_cache()
        ids2, mask2, pos2 = self._prefill_inputs(new)
        with self.model_lock, torch.inference_mode():
            logits2 = self._forward(ids2, mask2, pos2, new_cache)
            width = max(mask.shape[1], mask2.shape[1])
            for old, add in zip(cache.layers, new_cache.layers, strict=True):
                old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(add.keys, width)])
                old.values = torch.cat([_left_pad(old.values, width), _left_pad(add.values, width)])
        self.stats.joined += len(new)
        mask = torch.cat([_left_pad(mask, width, dim=1), _left_pad(mask2, width, dim=1)])
        positions = torch.cat([positions[:, -1:], pos2[:, -1:]])
        return rows + new, torch.cat([logits, logits2]), mask, positions

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _finished_before_prefill(self, r: GenerationRequest) -> bool:
        if r._abort_message is not None:
            self._finish(r, {"type": "abort", "message": r._abort_message})
            return True
        if len(r.output_ids) >= r.params.max_new_tokens:
            self._finish(r, {"type": "length", "length": r.params.max_new_tokens})
            return True
        return False

    def _advance(self, rows: list[GenerationRequest], tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append one token per row; finish rows that hit a stop; return indices still running."""
        keep = []
        for i, (r, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(r, tok)
            if reason is None:
                keep.append(i)
            else:
                self._finish(r, reason)
        return keep

    def _stop_reason(self, r: GenerationRequest, tok: int) -> dict[str, Any] | None:
        p = r.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(r.input_ids) + len(r.output_ids) >= self.max_positions:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _apply_control(self, rows: list[GenerationRequest], keep: list[int]) -> list[int]:
        """Between decode steps: honour aborts, then pauses. Returns the rows to keep decoding."""
        survivors = []
        for i in keep:
            r = rows[i]
            if r._abort_message is not None:
                self._finish(r, {"type": "abort", "message": r._abort_message})
            else:
                survivors.append(i)
        with self._cond:
            if self._paused_mode == "retract" and survivors:
                self._queue.extendleft(reversed([rows[i] for i in survivors]))
                return []
            # in_place: wait here, holding the KV cache but not the model lock; aborts issued
            # meanwhile finish their rows at once.
            while self._paused_mode == "in_place" and not self._stopping and survivors:
                self._cond.wait()
                survivors = [i for i in survivors if not self._finish_if_aborted(rows[i])]
            survivors = [i for i in survivors if not self._finish_if_aborted(rows[i])]
            self._running = [rows[i] for i in survivors]
            self._cond.notify_all()
        return survivors

    def _finish_if_aborted(self, r: GenerationRequest) -> bool:
        if r._abort_message is None:
            return False
        self._finish(r, {"type": "abort", "message": r._abort_message})
        return True

    def _drain_queue(self) -> list[GenerationRequest]:
        with self._cond:
            drained = list(self._queue)
            self._queue.clear()
            return drained

    def _finish_all(self, requests: list[GenerationRequest], message: str) -> None:
        for r in requests:
            if not r.done:
                self._finish(r, {"type": "abort", "message": message})

    def _finish(self, r: GenerationRequest, reason: dict[str, Any]) -> None:
        if r.done:
            return
        r.finish_reason = reason
        r.finished_at = time.monotonic()
        self.stats.requests_finished += 1
        r._done.set()
        if r.on_done is not None:
            r.on_done(r)


_MERGEABLE_LAYERS = ("DynamicLayer", "GrowingKVLayer")


def _mergeable(cache: Any) -> bool:
    """Only plain full-attention cache layers can be padded and stacked (not sliding/linear ones)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        type(layer).__name__ in _MERGEABLE_LAYERS and layer.is_initialized for layer in layers
    )


@functools.cache
def _growing_layer_class() -> type:
    """``transformers``' ``DynamicLayer`` with amortised growth (built on first use: transformers loads lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingKVLayer(DynamicLayer):
        """Keys/values are views into a buffer with room to grow, so a decode step writes its token in
        place instead of concatenating the whole cache (``DynamicLayer``: O(length) copy per step, 13% of a
        CPU decode of 128 x 16 tokens). Anything that replaces ``keys`` (batch selection, the continuous-
        batching merge, a crop) leaves the buffer behind, and the next update starts a new one."""

        _buf_k: torch.Tensor | None = None
        _buf_v: torch.Tensor | None = None

        def _in_buffer(self, add: torch.Tensor) -> bool:
            buf = self._buf_k
            return (
                buf is not None and self.keys.numel() > 0 and self.keys.data_ptr() == buf.data_ptr()
                and self.keys.stride() == buf.stride() and self.keys.shape[:-2] == add.shape[:-2]
                and self.keys.shape[-2] + add.shape[-2] <= buf.shape[-2]
            )

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.keys.shape[-2] if self.keys.numel() else 0
            end = n + key_states.shape[-2]
            if not self._in_buffer(key_states):
                shape = (*key_states.shape[:-2], end + max(32, end), key_states.shape[-1])  # x2 headroom
                self._buf_k, self._buf_v = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    self._buf_k[..., :n, :] = self.keys
                    self._buf_v[..., :n, :] = self.values
            assert self._buf_k is not None and self._buf_v is not None
            self._buf_k[..., n:end, :] = key_states
            self._buf_v[..., n:end, :] = value_states
            self.keys, self.values = self._buf_k[..., :end, :], self._buf_v[..., :end, :]
            return self.keys, self.values

    return GrowingKVLayer


def new_kv_cache() -> Any:
    """A ``DynamicCache`` whose layers grow in place (see ``GrowingKVLayer``); same results, faster decode.

    >>> cache = new_kv_cache()  # doctest: +SKIP
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    if hasattr(cache, "layer_class_to_replicate"):  # transformers' layered caches (5.x); else plain growth
        cache.layer_class_to_replicate = _growing_layer_class()
    return cache


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad ``t`` on the left of ``dim`` up to ``width`` (KV: [B, H, S, D] -> dim 2)."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32) and return (tokens [B], logprobs [B]).

    Greedy rows (temperature 0) take the argmax. Other rows sample from softmax(logits / T)
    restricted by top-k then top-p, using the row's own generator (exponential-race sampling:
    argmax(p / E) with E ~ Exp(1) draws from p). The returned log-prob is
    log_softmax(logits / T)[token] (raw logits at T = 0), without the top-k/top-p filter.
    """
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        sub = scaled[sampled_rows]
        sub = _filter_top_k_top_p(sub, [params[i] for i in sampled_rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.stack(
            [
                torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generators[i])
                for i in sampled_rows
            ]
        )
        tokens[sampled_rows] = (probs / noise).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _filter_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf."""
    vocab = scaled.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    drop = rank >= torch.tensor(ks, device=scaled.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = torch.tensor(ps, dtype=probs.dtype, device=scaled.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
