"""Serving while syncing: the rollout pause per sync, with and without double-buffered receive.

A real raygym server (``python -m raygym.engines.raygym_server.server``, HTTP, its own process) serves the benchmark's
~100M Qwen3 in bf16 while clients keep generating (each request: 16 prompt tokens, 4 new tokens). Full
syncs reach it over gloo through ``WeightSync.push``: without double buffering the server is paused for
the whole sync; with it the next version lands in a shadow copy while generation goes on and only the
switch holds the model. Without double buffering the clients also stop submitting for the sync (as
raygym's driver does: an engine that is paused for a sync has nothing to serve, and requests arriving
meanwhile would keep its ``/flush_cache`` from succeeding); with it they never stop. The pause mode is
``in_place``: requests in flight at a switch go on with the new weights instead of being aborted.
Per client, the gap between two of its completed requests is one request's latency; the pause a sync
causes is the longest such gap overlapping the sync minus the median gap away from syncs.
"""

from __future__ import annotations

import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from raygym.engine_api.protocol import Endpoint, GenerateRequest, body_fields

CLIENTS = 2
PROMPT_TOKENS, NEW_TOKENS = 16, 4
QUIET_COMPLETIONS = 6  # completions between two syncs (the baseline gaps)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_model(versions, config, path: str) -> None:
    """The first trained version as a Hugging Face checkpoint in bf16 (what the server starts from)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(config)
    missing, _ = model.load_state_dict({n: t.float() for n, t in versions[0].items()}, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embeddings
    model.bfloat16().save_pretrained(path)


class Clients:
    """``CLIENTS`` threads generating back to back; ``done`` holds (finish time, finished normally)."""

    def __init__(self, url: str, vocab: int):
        import httpx

        self.url, self.vocab = url, vocab
        self.done: list[tuple[int, float, bool]] = []  # (client, finish time, finished normally)
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._parked = 0
        self._client = httpx.Client(timeout=120)
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self._threads:
            t.start()

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            if not self._go.is_set():
                with self._lock:
                    self._parked += 1
                    self._lock.notify_all()
                self._go.wait()
                with self._lock:
                    self._parked -= 1
            body = body_fields(GenerateRequest(
                input_ids=[rng.randrange(2, self.vocab) for _ in range(PROMPT_TOKENS)],
                sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}))
            try:
                answer = self._client.post(f"{self.url}{Endpoint.GENERATE.value}", json=body).json()
                ok = answer["meta_info"]["finish_reason"]["type"] != "abort"
            except Exception:
                ok = False
            with self._lock:
                self.done.append((seed, time.perf_counter(), ok))
                self._lock.notify_all()

    def hold(self) -> None:
        """Stop submitting; returns once every client's request in flight has finished."""
        self._go.clear()
        with self._lock:
            while self._parked < len(self._threads):
                self._lock.wait()

    def release(self) -> None:
        self._go.set()

    def wait_completions(self, count: int, timeout: float = 300.0) -> None:
        """Block until ``count`` more requests completed normally."""
        with self._lock:
            target = sum(ok for _, _, ok in self.done) + count
            deadline = time.monotonic() + timeout
            while sum(ok for _, _, ok in self.done) < target:
                left = deadline - time.monotonic()
                assert left > 0, "the server stopped completing requests"
                self._lock.wait(left)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._go.set()
        for t in self._threads:
            t.join(timeout=120)
        self._client.close()


def pauses(done: list[tuple[int, float, bool]], windows: list[tuple[float, float]]) -> tuple[list[float], float]:
    """Per sync window: the longest gap between two consecutive normal completions of one client that
    overlaps it; and the median such gap overlapping no window.

    >>> pauses([(0, 0.0, True), (0, 1.0, True), (0, 2.0, True), (0, 5.0, True), (0, 6.0, True), (1, 3.0, True)],
    ...        [(2.5, 3.0)])
    ([3.0], 1.0)
    """
    gaps = []
    for client in {c for c, _, _ in done}:
        times = sorted(t for c, t, ok in done if ok and c == client)
        gaps += list(zip(times, times[1:], strict=False))
    per_window = [max((b - a for a, b in gaps if a < end and b > start), default=0.0) for start, end in windows]
    quiet = [b - a for a, b in gaps if not any(a < end and b > start for start, end in windows)]
    return per_window, statistics.median(quiet) if quiet else 0.0


def serving_pause(versions, config, args, emit) -> None:
    """Emit the rollout pause per sync with and without double buffering."""
    import httpx

    from raygym.bench.weight_sync_trainer import BenchTrainer, ping_pong
    from raygym.config import Recipe
    from raygym.weightsync.coordinator import WeightSync
    from raygym.weightsync.payload import LOADER

    model_dir = tempfile.mkdtemp(prefix="raygym-bench-model-")
    save_model(versions, config, model_dir)
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    server = subprocess.Popen([sys.executable, "-m", "raygym.engines.raygym_server.server", "--model-path", model_dir, "--host",
                               "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "bfloat16",
                               "--custom-weight-loader", LOADER, "--max-running-requests", "8",
                               "--weight-update-timeout", "300"], env=env, stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    clients = None
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"server exited with {server.returncode}"
            try:
                if httpx.get(f"{url}{Endpoint.HEALTH.value}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not healthy in 300 s"
            time.sleep(0.5)
        clients = Clients(url, config.vocab_size)
        clients.wait_completions(QUIET_COMPLETIONS)
        schedule = ping_pong(args.steps, args.serving_syncs)
        results: dict[bool, dict[str, list]] = {}  # double buffered or not -> its windows and reports
        for double_buffer in (False, True, True, False):  # ABBA against drift
            recipe = Recipe(update_weight_mode="full", update_weight_transport="nccl",
                            update_weight_buffer_size=int(args.bucket_mb * 1024 * 1024), update_weight_timeout=300.0,
                            colocate=False, update_weight_double_buffer=double_buffer,
                            update_weight_pause_mode="in_place")
            trainer = BenchTrainer(versions)
            trainer.schedule = {1: 0, **{i + 2: v for i, v in enumerate(schedule)}}
            sync = WeightSync(recipe, [trainer], [url], spec_overrides={"master_address": "127.0.0.1",
                                                                        "backend": "gloo"})
            sync.setup()
            windows, reported = [], []
            try:
                if not double_buffer:
                    clients.hold()
                sync.push(1)
                clients.release()
                for wire in range(2, len(schedule) + 2):
                    clients.wait_completions(QUIET_COMPLETIONS)
                    start = time.perf_counter()
                    if not double_buffer:
                        clients.hold()
                    m = sync.push(wire)
                    clients.release()
                    windows.append((start, time.perf_counter()))
                    reported.append(m["sync/pause_s"])
                    assert m["sync/full_resyncs"] == 0.0
            finally:
                sync.shutdown()
            clients.wait_completions(QUIET_COMPLETIONS)
            entry = results.setdefault(double_buffer, {"windows": [], "reported": []})
            entry["windows"] += windows
            entry["reported"] += reported
        clients.stop()
        every = [w for r in results.values() for w in r["windows"]]
        _, quiet = pauses(clients.done, every)
        summary = {}
        for double_buffer, r in results.items():
            gaps, _ = pauses(clients.done, r["windows"])
            summary[double_buffer] = statistics.mean(max(0.0, g - quiet) for g in gaps)
            sync_s = statistics.mean(b - a for a, b in r["windows"])
            emit("serving_pause_per_sync" + ("_double_buffered" if double_buffer else ""), summary[double_buffer],
                 baseline=sync_s, ratio=summary[double_buffer] / sync_s,
                 ratio_is="rollout pause per sync (longest per-client completion gap overlapping the sync minus "
                          "the median gap away from syncs) / sync duration",
                 median_pause_s=statistics.median(max(0.0, g - quiet) for g in gaps),
                 median_request_gap_s=quiet, engine_reported_pause_s=statistics.mean(r["reported"]),
                 gaps=gaps, syncs=len(r["windows"]), clients=CLIENTS, new_tokens=NEW_TOKENS, pause_mode="in_place")
        emit("serving_pause_double_buffered_vs_paused", summary[True], baseline=summary[False],
             ratio=summary[True] / summary[False] if summary[False] else None,
             ratio_is="rollout pause per sync with / without double buffering")
    finally:
        if clients is not None:
            clients.stop()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
