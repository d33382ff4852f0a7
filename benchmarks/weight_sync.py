"""Weight-sync benchmark: a ~100M-parameter Qwen3 model trained for real, pushed to 2 receivers.

The trainer side is a real ``Qwen3ForCausalLM`` (HF init: std 0.02, norms at 1.0, tied embeddings)
with fp32 master weights stepped by ``torch.optim.AdamW`` at the recipe's defaults (lr 1e-6, betas
0.9/0.98, weight decay 0.1) on a next-token loss over random tokens. Warm-up steps first, so Adam's
moments are realistic; then the engines get the bf16 cast of the weights after each further step.

Receivers are separate processes running raygym's engine-side code (``WeightReceiver`` +
``load_payload``: group join, broadcast receive, decode, apply in place, checksum verification)
without an HTTP server, so the figures measure the transport. After every sync the receivers'
checksums are compared with the trainer's (not timed). One JSON object per line: figure, value,
baseline measured in the same run, ratio (its definition in ``ratio_is``), goal, machine.

    python benchmarks/weight_sync.py [--hidden 768 --layers 12 --vocab 32000] [--warm-steps 3]
                                     [--steps 2] [--bucket-mb 32] [--reps 2] [--disk-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

MACHINE = {"cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__, "platform": platform.platform()}


# --------------------------------------------------------------------------- receivers


class NamedTensors(torch.nn.Module):
    """A model that is just HF-named tensors (what the loader writes into)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs):  # the loader addresses tensors by HF name
        return dict(self.tensors)


def receiver_main(conn, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A receiver process: answers engine endpoints sent over ``conn``, in order, until told to stop."""
    from raygym.weightsync.codec import dtype_from_name
    from raygym.weightsync.receiver import WeightReceiver
    from raygym.weightsync.transport_dist import broadcast

    torch.set_num_threads(1)
    model = NamedTensors({n: torch.zeros(s, dtype=dtype_from_name(d)) for n, (s, d) in shapes.items()})
    receiver = WeightReceiver(model, timeout_s=300)
    raw = torch.empty(0, dtype=torch.uint8)
    while True:
        endpoint, payload = conn.recv()
        if endpoint == "stop":
            return
        try:
            if endpoint == "raw_broadcast":  # the baseline: the same bytes, no decoding, no checksums
                if raw.numel() != payload["nbytes"]:
                    raw = torch.empty(payload["nbytes"], dtype=torch.uint8)
                for start in range(0, payload["nbytes"], payload["piece"]):
                    broadcast(receiver.groups[payload["group_name"]].pg, raw[start : start + payload["piece"]], 300)
                answer = {"success": True}
            else:
                answer = getattr(receiver, endpoint)(**payload)
        except Exception as exc:  # reported to the sender, which names this receiver
            answer = {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        conn.send(answer)


class PipeEngineLink:
    """EngineLink to a receiver process over a pipe; several calls may be outstanding (answered in order)."""

    def __init__(self, conn, name: str):
        self.conn, self.name = conn, name
        self._lock = threading.Lock()
        self._waiting: deque[Future] = deque()
        threading.Thread(target=self._read, daemon=True).start()

    def call(self, endpoint, payload, timeout, method="POST"):
        fut: Future = Future()
        with self._lock:
            self._waiting.append(fut)
            self.conn.send((endpoint, payload))
        return fut.result(timeout=timeout)

    def _read(self) -> None:
        while True:
            try:
                answer = self.conn.recv()
            except (EOFError, OSError):
                return
            self._waiting.popleft().set_result(answer)


# --------------------------------------------------------------------------- trainer


def build_model(args) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = args.hidden // 64
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                         head_dim=64, tie_word_embeddings=True, initializer_range=0.02, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def train_step(model, opt, gen: torch.Generator, args) -> None:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def engine_weights(model) -> dict[str, torch.Tensor]:
    """What the engines serve: the bf16 cast of every parameter, by HF name (tied weights once)."""
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- output


def emit(figure: str, value: float, unit: str = "s", baseline: float | None = None, ratio: float | None = None,
         ratio_is: str | None = None, goal: str | None = None, **extra) -> None:
    row: dict = {"figure": figure, "value": round(value, 6), "unit": unit}
    if baseline is not None:
        row["baseline"] = round(baseline, 6)
    if ratio is not None:
        row.update(ratio=round(ratio, 4), ratio_is=ratio_is)
    if goal:
        row["goal"] = goal
    row.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in extra.items()})
    row["machine"] = {**MACHINE, "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(row), flush=True)


def main() -> None:
    from raygym.weightsync.codec import ENCODINGS, checksum, encode_delta
    from raygym.weightsync.sender import SenderSpec, WeightSender
    from raygym.weightsync.transport_dist import broadcast

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="measured steps, one delta sync each")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the full syncs and baselines (best kept)")
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--receivers", type=int, default=2)
    args = ap.parse_args()

    # ---- trainer: warm-up steps, then the weights of every measured step
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    for _ in range(args.warm_steps):
        train_step(model, opt, gen, args)
    versions = [engine_weights(model)]
    for _ in range(args.steps):
        train_step(model, opt, gen, args)
        versions.append(engine_weights(model))
    train_s = time.perf_counter() - t0
    del opt, model
    v0 = versions[0]
    names = list(v0)
    numel = sum(t.numel() for t in v0.values())
    total_bytes = numel * 2
    emit("model", float(numel), unit="params", bytes=total_bytes, tensors=len(names), train_s=train_s,
         warm_steps=args.warm_steps, steps=args.steps, lr=args.lr)

    # ---- physical reference: memcpy of the same bytes into memory that already exists
    memcpy_s = memcpy_seconds(total_bytes)
    emit("memcpy_same_bytes", memcpy_s, bytes=total_bytes, gbps=total_bytes / 1e9 / memcpy_s)

    # ---- what changes per step, and payload sizes per encoding (pure codec, no transport)
    fracs = []
    for step in range(1, len(versions)):
        changed = sum(int((versions[step][n].view(torch.int16) != versions[step - 1][n].view(torch.int16)).sum())
                      for n in names)
        fracs.append(changed / numel)
        emit("changed_fraction", changed / numel, unit="fraction", step=step)
    for enc in ENCODINGS:
        t0 = time.perf_counter()
        size = sum(len(encode_delta(versions[1][n], v0[n], enc)) for n in names)
        emit(f"payload_delta_over_full[{enc}]", size / total_bytes, unit="ratio", baseline=fracs[0],
             ratio=size / total_bytes / fracs[0], ratio_is="payload ratio / changed fraction",
             goal="<= 0.06" if enc == "indices" else None, encode_s=time.perf_counter() - t0, payload_bytes=size)

    # ---- receivers
    ctx = mp.get_context("spawn")
    shapes = {n: (tuple(t.shape), "bfloat16") for n, t in v0.items()}
    procs, links = [], []
    for i in range(args.receivers):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=receiver_main, args=(b, shapes), daemon=True)
        proc.start()
        procs.append(proc)
        links.append(PipeEngineLink(a, f"receiver{i}"))
    want = {v: {n: checksum(t) for n, t in w.items()} for v, w in enumerate(versions)}
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="raygym-bench-")
    bucket = int(args.bucket_mb * 1024 * 1024)

    def sender(transport: str, mode: str) -> WeightSender:
        s = WeightSender(SenderSpec(engines=links, transport=transport, mode=mode, encoding="indices",
                                    buffer_size=bucket, timeout_s=300, disk_dir=disk_dir,
                                    master_address="127.0.0.1", backend="gloo"))
        s.setup()
        return s

    def timed_push(s: WeightSender, wire_version: int, weights_version: int) -> tuple[float, dict]:
        t0 = time.perf_counter()
        result = s.push(wire_version, versions[weights_version].items())
        s.commit(wire_version)
        elapsed = time.perf_counter() - t0
        for link in links:  # verify outside the timing: the receivers hold exactly these bytes
            got = link.call("weights_checksum", {"names": None}, 300)["checksums"]
            assert got == want[weights_version], f"{link.name} differs after version {wire_version}"
        return elapsed, result["metrics"]

    def raw_broadcast(s: WeightSender, piece: int) -> float:
        flat = torch.ones(total_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        futures = [s.transport._pool.submit(link.call, "raw_broadcast", {"group_name": s.transport.group_name,
                                            "nbytes": total_bytes, "piece": piece}, 300) for link in links]
        for start in range(0, total_bytes, piece):
            broadcast(s.transport._pg, flat[start : start + piece], 300)
        for f in futures:
            assert f.result()["success"]
        return time.perf_counter() - t0

    try:
        # gloo baselines: the same bytes as one buffer, and in bucket-size pieces
        full_sender = sender("nccl", "full")
        pieces = min(bucket, full_sender.bucket_bytes()) if hasattr(full_sender, "bucket_bytes") else bucket
        raw_s = min(raw_broadcast(full_sender, total_bytes) for _ in range(args.reps))
        emit("gloo_raw_broadcast_one_buffer", raw_s, baseline=memcpy_s, ratio=memcpy_s / raw_s,
             ratio_is="memcpy / this", gbps=total_bytes / 1e9 / raw_s, receivers=args.receivers)
        raw_pieces_s = min(raw_broadcast(full_sender, pieces) for _ in range(args.reps))
        emit("gloo_raw_broadcast_bucket_pieces", raw_pieces_s, baseline=raw_s, ratio=raw_s / raw_pieces_s,
             ratio_is="one buffer / pieces", piece_bytes=pieces)

        # full sync (mode full), best of reps
        runs = [timed_push(full_sender, rep + 1, 0) for rep in range(args.reps)]
        full_s, full_m = min(runs, key=lambda r: r[0])
        emit("gloo_full_sync", full_s, baseline=raw_s, ratio=raw_s / full_s, ratio_is="raw one-buffer broadcast / full",
             goal=">= 0.8", ratio_vs_pieces=raw_pieces_s / full_s, **_breakdown(full_m))
        full_sender.close()

        # delta sender: its first push is full and seeds the snapshot, then one delta per step
        delta_sender = sender("nccl", "delta")
        seed_s, seed_m = timed_push(delta_sender, 1, 0)
        emit("gloo_full_sync_seeding_snapshot", seed_s, baseline=full_s, ratio=seed_s / full_s,
             ratio_is="this / full sync", **_breakdown(seed_m))
        deltas = [timed_push(delta_sender, step + 1, step) for step in range(1, len(versions))]
        for step, (delta_s, dm) in enumerate(deltas, start=1):
            emit("gloo_delta_sync", delta_s, baseline=full_s, ratio=delta_s / full_s, ratio_is="delta / full",
                 goal="<= 0.5", step=step, **_breakdown(dm))
        delta_sender.close()

        # disk: full (best of reps, mode full) vs delta per step
        disk_full = sender("disk", "full")
        dfull_s, dfull_m = min((timed_push(disk_full, rep + 1, 0) for rep in range(args.reps)), key=lambda r: r[0])
        emit("disk_full_sync", dfull_s, dir=disk_dir, **_breakdown(dfull_m))
        disk_full.close()
        disk = sender("disk", "delta")
        timed_push(disk, 1, 0)
        for step in range(1, len(versions)):
            ddelta_s, dm = timed_push(disk, step + 1, step)
            emit("disk_delta_sync", ddelta_s, baseline=dfull_s, ratio=ddelta_s / dfull_s, ratio_is="delta / full",
                 goal="<= 0.25", step=step, **_breakdown(dm))
        disk.close()
    finally:
        for link in links:
            link.conn.send(("stop", {}))
        for proc in procs:
            proc.join(timeout=30)
        if not args.disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


def memcpy_seconds(nbytes: int) -> float:
    """Best of 3 copies of ``nbytes`` between buffers that already exist (torch's threaded copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return min(_timed(lambda: dst.copy_(src)) for _ in range(3))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _breakdown(m: dict[str, float]) -> dict[str, float]:
    keys = ("sync/bytes", "sync/changed_frac", "sync/encode_s", "sync/transfer_s", "sync/wait_s", "sync/buckets")
    return {k.removeprefix("sync/"): m[k] for k in keys if k in m}


if __name__ == "__main__":
    main()
