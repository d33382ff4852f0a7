"""Batched generation for raygym's built-in inference server: pure torch, no HTTP.

A :class:`GenerationEngine` owns one Hugging Face causal LM and a worker thread. Callers
:meth:`~GenerationEngine.submit` :class:`GenerationRequest` objects from any thread; the worker
drains the queue into one batch (up to ``max_running_requests`` rows), prefills it with left
padding (attention mask + position ids), then decodes step by step with a KV cache. Each row has
its own sampling parameters and stop conditions; finished rows leave the batch (their KV cache
rows are dropped); requests that arrive meanwhile are prefilled and join the running batch
between decode steps (continuous batching). Abort and pause are checked between decode steps.

A vision-language model also takes images (:meth:`GenerationEngine.prepare_images`); each row keeps its own
M-RoPE delta through decoding and batching (:mod:`raygym.engines.raygym_server.vision_inputs`).

Sampling and its log-probs are :mod:`raygym.engines.raygym_server.sampling`'s; the KV cache :mod:`raygym.engines.raygym_server.kv_cache`'s.

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
import inspect
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from raygym.cluster.cpu_threads import claim_torch_threads
from raygym.engine_api.protocol import PAUSE_MODES
from raygym.engines.raygym_server import routing_capture
from raygym.engines.raygym_server import vision_inputs as vi
from raygym.engines.raygym_server.generation_request import (
    EngineBusy,
    EngineStats,
    EngineUnavailable,
    GenerationRequest,
    release_host_memory,
)
from raygym.engines.raygym_server.kv_cache import _left_pad, _mergeable, fill_order, new_kv_cache
from raygym.engines.raygym_server.sampling import SamplingParams, sample_next_tokens
from raygym.vision.model_inputs import embed_with_images

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["EngineBusy", "EngineUnavailable", "GenerationEngine", "GenerationRequest", "SamplingParams", "new_kv_cache"]


class GenerationEngine:
    """A request queue feeding batched KV-cached generation on one HF causal LM.

    Thread model: one worker thread runs every forward pass while holding ``model_lock``;
    :meth:`exclusive` lets another thread (weight updates, memory moves) take the model between
    decode steps. ``batch_wait_s`` is how long the worker lingers after the first queued request
    so that concurrent arrivals share a batch. ``image_processor``: a vision-language model's (the
    checkpoint's ``AutoImageProcessor``), needed for requests with images.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        max_running_requests: int = 64,
        seed: int = 0,
        batch_wait_s: float = 0.003,
        pad_token_id: int = 0,
        max_queued_requests: int = 4096,
        compute_threads: int | None = None,
        image_processor: Any = None,
    ) -> None:
        self.model = model.eval()
        self.vision = vi.VisionSupport.from_model(model, image_processor)  # None: a text-only model
        # CPU: torch threads of the worker thread, claimed by it alone (raygym/cluster/cpu_threads.py); None: the
        # process's setting
        self.compute_threads = compute_threads
        self.max_queued_requests = max_queued_requests
        self.tokenizer = tokenizer
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.max_running_requests = max_running_requests
        self.batch_wait_s = batch_wait_s
        self.pad_token_id = pad_token_id
        text_config = model.config.get_text_config()  # a vision-language model's language model
        self.vocab_size = int(text_config.vocab_size)
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 1 << 30))
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
        self._trim_due = False  # host memory to hand back once idle (after an abort of everything)
        self._thread: threading.Thread | None = None
        # The version label of the weights (the server's receiver owns it and changes it only while it holds
        # the model); read under the model lock at every forward pass.
        self.weight_label: Callable[[], str] = lambda: "0"
        self._forward_label = "0"  # the label of the last forward pass of the worker
        self.routing: routing_capture.RoutingCapture | None = None  # MoE: routers' choices for requests that ask

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
        """Queue a request (thread-safe). Raises :class:`EngineUnavailable` while memory is released and
        :class:`EngineBusy` when the queue holds ``max_queued_requests`` already."""
        self.submit_all([request])

    def submit_all(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests all or none: when they do not all fit the queue, none is queued (EngineBusy)."""
        with self._cond:
            if self._stopping:
                raise EngineUnavailable("the generation engine is stopped")
            if self._released:
                raise EngineUnavailable(
                    "memory is released (/release_memory_occupation); call /resume_memory_occupation first"
                )
            if len(self._queue) + len(requests) > self.max_queued_requests:
                raise EngineBusy(
                    f"the request queue is full ({len(self._queue)} waiting, max_queued_requests="
                    f"{self.max_queued_requests}); retry later")
            for request in requests:
                seed = request.params.sampling_seed
                if seed is None:
                    seed = self._rng.getrandbits(63)
                request._generator = torch.Generator(device=self.device).manual_seed(seed)
                self._queue.append(request)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request by rid (or every request); returns how many were aborted."""
        with self._cond:
            hit = [r for r in (*self._queue, *self._running) if abort_all or r.rid == rid]
            self._trim_due = self._trim_due or (abort_all and bool(hit))
            for r in hit:
                r._abort_message = message
            queued = [r for r in self._queue if r._abort_message is not None]
            self._queue = collections.deque(r for r in self._queue if r._abort_message is None)
            self._cond.notify_all()
        self._finish_all(queued, message)
        return len(hit)

    def cancel(self, requests: Sequence[GenerationRequest], message: str) -> None:
        """Abort these very requests (e.g. their client went away); their slots free within a decode step."""
        with self._cond:
            for r in requests:
                if not r.done:
                    r._abort_message = message
            queued = [r for r in self._queue if r._abort_message is not None]
            self._queue = collections.deque(r for r in self._queue if r._abort_message is None)
            self._cond.notify_all()
        self._finish_all(queued, message)

    def pending(self) -> int:
        """Requests queued or running and not yet answered (a request is answered before its batch
        bookkeeping ends, so counting the lists alone would race with a client's next call)."""
        with self._cond:
            return sum(not r.done for r in (*self._queue, *self._running))

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

    def prepare_images(self, input_ids: Sequence[int], images: Sequence[vi.ImageRef]) -> vi.ImageInputs | None:
        """The ``images`` of a request whose (expanded) prompt is ``input_ids`` (None without images);
        ValueError saying what is wrong (:func:`~raygym.engines.raygym_server.vision_inputs.prepare_images`)."""
        return vi.prepare_images(self.vision, vi.model_name(self.model), input_ids, images)

    def score(self, input_ids: list[int], images: vi.ImageInputs | None = None) -> list[float]:
        """``log_softmax(logits)`` of each token of ``input_ids`` given the ones before it (from the second
        token on; raw logits, as SGLang's ``input_token_logprobs``), with the prompt's ``images``. Runs between
        decode steps."""
        if len(input_ids) < 2:
            return []
        inputs = vi.score_inputs(input_ids, images, self.device)
        with self.model_lock, torch.inference_mode():
            logits = self.model(**inputs, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1).tolist()

    def set_released(self, released: bool) -> None:
        with self._cond:
            self._released = released
            self._cond.notify_all()

    @property
    def released(self) -> bool:
        return self._released

    # ----- worker -----
    def _loop(self) -> None:
        if self.compute_threads is not None:
            claim_torch_threads(self.compute_threads)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            except Exception as exc:  # a model error must not kill the worker, nor leave a request unanswered
                with self._cond:
                    involved = list({id(r): r for r in (*batch, *self._running)}.values())
                self._finish_all(involved, f"generation failed: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._running = []
                    idle = not self._queue
                    self._cond.notify_all()
                if idle and (self._trim_due or len(batch) >= 256):
                    self._trim_due = False
                    release_host_memory()

    def _can_start(self) -> bool:
        return bool(self._queue) and self._paused_mode is None and self._holds == 0 and not self._released

    def _next_batch(self) -> list[GenerationRequest] | None:
        with self._cond:
            while not self._stopping and not self._can_start():
                self._park()
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
        """Prefill ``rows``, then decode them (and requests that join) to the end. Every token is stamped with
        the weight version of the forward pass that produced its logits; when the weights change under a
        running batch (an in-flight update), the batch goes back to the queue and is re-prefilled on the new
        weights, so each token's log-prob is exactly its version's (the KV cache is recomputed, as SGLang's
        retract does)."""
        rows = [r for r in rows if not self._finished_before_prefill(r)]
        if not rows:
            return
        self.stats.batches += 1
        self.stats.recent_batch_sizes.append(len(rows))
        rows, logits, mask, positions, cache = self._prefill_isolating(rows)
        label = self._forward_label
        while rows:
            joined = self._join_waiting(rows, logits, mask, positions, cache, label)
            if joined is None:
                return
            rows, logits, mask, positions = joined
            self.stats.max_batch_size = max(self.stats.max_batch_size, len(rows))
            with self.model_lock, torch.inference_mode():
                tokens, logprobs = sample_next_tokens(
                    logits, [r.params for r in rows], [r._generator for r in rows]
                )
            keep = self._advance(rows, tokens.tolist(), logprobs.tolist(), label)
            keep = self._apply_control(rows, keep)
            if not keep:
                return
            if len(keep) < len(rows):
                order = fill_order(keep)  # finished rows' places are taken by rows from the end of the batch
                index = torch.tensor(order, device=mask.device)
                with torch.inference_mode():  # the cache's tensors are inference tensors, compacted in place
                    cache.batch_select_indices(index)
                mask, positions, tokens = mask[index], positions[index], tokens[index]
                rows = [rows[i] for i in order]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            positions = positions[:, -1:] + 1
            try:
                with self.model_lock, torch.inference_mode():
                    current = self.weight_label()
                    if current == label:
                        logits = self._forward(tokens[:, None], mask, positions, cache)
                        routing_capture.record(self.routing, rows, 1, prefill=False)
            except Exception as exc:  # a failed decode step: every row goes back to be re-prefilled
                self._retract_after_failure(rows, exc)
                return
            if current != label:
                self._recompute(rows)
                return

    def _recompute(self, rows: list[GenerationRequest]) -> None:
        """The weights changed under ``rows``: back to the head of the queue, to be re-prefilled (prompt and
        tokens so far) on the new weights."""
        self.stats.recomputed += len(rows)
        with self._cond:
            self._queue.extendleft(reversed(rows))
            self._running = []
            self._cond.notify_all()

    def _prefill_isolating(self, rows: list[GenerationRequest]) -> tuple[list[GenerationRequest], Any, Any, Any, Any]:
        """Prefill ``rows`` into a new KV cache; when the batch fails, find the rows that fail alone, answer
        them with the error, and prefill the others without them. Returns (rows that run, logits, mask,
        positions, cache)."""
        cache = new_kv_cache()
        try:
            p = self._prefill_inputs(rows)
            with self.model_lock, torch.inference_mode():
                self._forward_label = self.weight_label()
                logits = self._forward(p.input_ids, p.mask, p.positions, cache, p.model_kwargs)
                routing_capture.record(self.routing, rows, p.input_ids.shape[1], prefill=True)
                return rows, logits, p.mask, p.positions, cache
        except Exception as exc:
            if len(rows) == 1:
                self._finish(rows[0], {"type": "abort", "message": f"prefill failed: {type(exc).__name__}: {exc}"})
                return [], None, None, None, None
        good = [r for r in rows if self._prefills_alone(r)]
        if len(good) == len(rows):  # every row prefills alone but not together: the batch is the problem
            self._finish_all(good, "prefill of the batch failed although each request prefills alone")
            good = []
        return self._prefill_isolating(good) if good else ([], None, None, None, None)

    def _prefills_alone(self, r: GenerationRequest) -> bool:
        try:
            p = self._prefill_inputs([r])
            with self.model_lock, torch.inference_mode():
                self._forward(p.input_ids, p.mask, p.positions, new_kv_cache(), p.model_kwargs)
            return True
        except Exception as exc:
            self._finish(r, {"type": "abort", "message": f"prefill failed: {type(exc).__name__}: {exc}"})
            return False

    def _retract_after_failure(self, rows: list[GenerationRequest], exc: Exception) -> None:
        """Put ``rows`` back at the head of the queue (their tokens so far are kept and re-prefilled, where
        a row that breaks the forward pass is found alone); a row in its second failed step is answered."""
        again: list[GenerationRequest] = []
        failed: list[GenerationRequest] = []
        for r in rows:
            r._failures += 1
            (failed if r._failures >= 2 else again).append(r)
        self._finish_all(failed, f"generation failed: {type(exc).__name__}: {exc}")
        with self._cond:
            self._queue.extendleft(reversed(again))
            self._running = []
            self._cond.notify_all()

    def _prefill_inputs(self, rows: list[GenerationRequest]) -> vi.Prefill:
        """Left-padded ids, attention mask and position ids [B, T] for prompt + tokens so far (and the rows'
        images: :func:`~raygym.engines.raygym_server.vision_inputs.build_prefill`)."""
        return vi.build_prefill([r.input_ids + r.output_ids for r in rows], [r.images for r in rows],
                             pad_token_id=self.pad_token_id, device=self.device)

    def _join_waiting(self, rows, logits, mask, positions, cache, label):
        """Continuous batching: prefill queued requests and merge them into the running batch.

        The two KV caches are left-padded to the same length (padding masked out) and stacked
        along the batch; per-row position ids (with each row's M-RoPE delta) make the padding invisible to the model. Returns None
        when the weights changed between the batch's last forward pass and the newcomers' prefill:
        both went back to the queue to be re-prefilled together.
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
        new, logits2, mask2, pos2, new_cache = self._prefill_isolating(new)
        with self._cond:  # rows that failed their prefill were answered: they no longer run
            self._running = [r for r in self._running if not r.done]
        if not new:
            return rows, logits, mask, positions
        if self._forward_label != label:
            self._recompute(rows + new)
            return None
        with self.model_lock, torch.inference_mode():
            width = max(mask.shape[1], mask2.shape[1])
            for old, add in zip(cache.layers, new_cache.layers, strict=True):
                old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(add.keys, width)])
                old.values = torch.cat([_left_pad(old.values, width), _left_pad(add.values, width)])
        self.stats.joined += len(new)
        mask = torch.cat([_left_pad(mask, width, dim=1), _left_pad(mask2, width, dim=1)])
        positions = torch.cat([positions[:, -1:], pos2[:, -1:]])
        return rows + new, torch.cat([logits, logits2]), mask, positions

    def _forward(self, input_ids, mask, positions, cache, model_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        """The last position's logits; ``model_kwargs``: a prefill's images and 3-D M-RoPE positions."""
        extra = dict(model_kwargs or {})
        if "pixel_values" in extra:  # images go in as embeddings: generated pads stay text (vision_inputs)
            input_ids, extra["inputs_embeds"] = None, embed_with_images(
                self.model, input_ids, extra.pop("image_mask"), extra.pop("pixel_values"), extra.pop("image_grid_thw"))
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=extra.pop("position_ids", positions),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
            **extra,
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

    def _advance(self, rows: list[GenerationRequest], tokens: list[int], logprobs: list[float], label: str
                 ) -> list[int]:
        """Append one token per row (made by weights ``label``); finish rows that hit a stop; return indices
        still running."""
        keep = []
        for i, (r, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(label)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(r, tok)
            if reason is None:
                keep.append(i)
                if r.on_token is not None:
                    r.on_token(r)
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
                self._park()
                survivors = [i for i in survivors if not self._finish_if_aborted(rows[i])]
            survivors = [i for i in survivors if not self._finish_if_aborted(rows[i])]
            self._running = [rows[i] for i in survivors]
            self._cond.notify_all()
        return survivors

    def _park(self) -> None:
        """Wait for a change (the condition's lock held), counted and visible in ``stats``."""
        self.stats.parks += 1
        self.stats.parked = True
        self._cond.notify_all()  # for wait_parked
        self._cond.wait()
        self.stats.parked = False

    def wait_parked(self, after: int = 0, timeout: float = 30.0) -> bool:
        """Wait until the worker waits, having parked more than ``after`` times: it decodes nothing then,
        until what it waits for changes (tests see a pause take effect)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self.stats.parked and self.stats.parks > after) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self.stats.parked and self.stats.parks > after

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
