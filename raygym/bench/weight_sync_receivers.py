"""Receiver processes for the weight-sync benchmark: raygym's engine-side code without an HTTP server.

Each receiver is a spawned process holding a model that is just HF-named tensors; it answers engine
endpoints sent over a pipe with :class:`raygym.engines.serving.weight_receiver.WeightReceiver` (group join, pipelined
broadcast receive, decode, apply, checksums, shadow copies). A receiver may first enter a network
namespace (a throttled link, see ``shaped_link.py``); ``GLOO_SOCKET_IFNAME`` names the interface gloo uses.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from raygym.engine_api.protocol import Endpoint, body_fields

CLONE_NEWNET = 0x40000000


class NamedTensors(torch.nn.Module):
    """A model that is just HF-named tensors (what the loader writes into)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for i, tensor in enumerate(tensors.values()):
            self.register_buffer(f"t{i}", tensor)
        self._names = {name: f"t{i}" for i, name in enumerate(tensors)}

    def state_dict(self, *args, keep_vars: bool = False, **kwargs):  # the loader addresses tensors by HF name
        return {name: self._buffers[key] for name, key in self._names.items()}


def enter_netns(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at ``path`` (``/run/netns/NAME``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path}) failed")
    finally:
        os.close(fd)


def receiver_main(conn, shapes: dict[str, tuple[tuple[int, ...], str]], netns: str | None, ifname: str) -> None:
    """A receiver process: answers engine endpoints sent over ``conn``, in order, until told to stop."""
    if netns:
        enter_netns(netns)
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    from raygym.engines.serving.weight_receiver import WeightReceiver
    from raygym.weightsync.codec import dtype_from_name
    from raygym.weightsync.engine_link import method_name
    from raygym.weightsync.transport_dist import broadcast

    torch.set_num_threads(1)
    model = NamedTensors({n: torch.zeros(s, dtype=dtype_from_name(d)) for n, (s, d) in shapes.items()})
    receiver = WeightReceiver(model, timeout_s=300)
    raw = torch.empty(0, dtype=torch.uint8)
    answers: queue.Queue[Future | None] = queue.Queue()  # every answer, in request order

    def send_answers() -> None:
        while (fut := answers.get()) is not None:
            conn.send(fut.result())

    sender = threading.Thread(target=send_answers, daemon=True)
    sender.start()
    last: Future | None = None
    while True:
        endpoint, payload = conn.recv()
        if endpoint == "stop":
            answers.put(None)
            sender.join(timeout=60)
            return
        name = method_name(endpoint) if isinstance(endpoint, Endpoint) else endpoint
        if name == "update_weights_from_distributed":  # pipelined: bucket k+1 is received while k loads
            last = receiver.submit_distributed(**payload)
            answers.put(last)
            continue
        if last is not None:
            last.result()  # an update in progress finishes before anything else is answered
        done: Future = Future()
        try:
            if name == "raw_broadcast":  # the baseline: the same bytes, no decoding, no checksums
                if raw.numel() != payload["nbytes"]:
                    raw = torch.empty(payload["nbytes"], dtype=torch.uint8)
                pg = receiver.groups[payload["group_name"]].pg
                for start in range(0, payload["nbytes"], payload["piece"]):
                    broadcast(pg, raw[start : start + payload["piece"]], 300)
                done.set_result({"success": True})
            else:
                done.set_result(getattr(receiver, name)(**payload))
        except Exception as exc:  # reported to the sender, which names this receiver
            done.set_result({"success": False, "message": f"{type(exc).__name__}: {exc}"})
        answers.put(done)


class PipeEngineLink:
    """EngineLink to a receiver process over a pipe; several calls may be outstanding (answered in order)."""

    def __init__(self, conn, name: str):
        self.conn, self.name = conn, name
        self._lock = threading.Lock()
        self._waiting: deque[Future] = deque()
        threading.Thread(target=self._read, daemon=True).start()

    def call(self, endpoint: Endpoint | str, body: Any, timeout: float) -> Any:
        """``endpoint``: a protocol Endpoint with its request model, or ``"raw_broadcast"`` with a dict."""
        fut: Future = Future()
        with self._lock:
            self._waiting.append(fut)
            self.conn.send((endpoint, body if isinstance(body, dict) else body_fields(body)))
        return fut.result(timeout=timeout)

    def _read(self) -> None:
        while True:
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                return
            self._waiting.popleft().set_result(answer)


class Receivers:
    """``count`` receiver processes (optionally inside network namespace ``netns``); ``links`` talk to them."""

    def __init__(self, count: int, shapes: dict, *, netns: str | None = None, ifname: str = "lo", tag: str = ""):
        ctx = mp.get_context("spawn")
        self.procs, self.links = [], []
        for i in range(count):
            a, b = ctx.Pipe()
            proc = ctx.Process(target=receiver_main, args=(b, shapes, netns, ifname), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.links.append(PipeEngineLink(a, f"receiver{tag}{i}"))
        for link in self.links:  # started and holding their model: nothing else competes for the CPU later
            assert link.call(Endpoint.MODEL_INFO, None, 600)["is_generation"]

    def close(self) -> None:
        for link in self.links:
            try:
                link.conn.send(("stop", {}))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
