"""Weight-sync benchmark: ~100M bf16 parameters (a random Qwen3-like set of tensors) after a real AdamW step
at lr 1e-6 (random gradients on fp32 master weights), 2 receivers, one run.

Receivers are plain processes running raygym's engine-side code (``WeightReceiver`` + ``load_payload``:
group join, broadcast receive, decode, apply, checksum verification) without an HTTP server, so the
figures measure the transport. Prints one JSON object per line: figure, value, baseline, ratio, machine.

    python benchmarks/weight_sync.py [--params 100e6] [--bucket-mb 16] [--disk-dir /tmp/raygym-bench]
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
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

GROUP_PROTOCOL = "sglang"


class NamedTensors(torch.nn.Module):
    """A model that is just HF-named tensors (what the loader writes into)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs):  # the loader addresses tensors by HF name
        return dict(self.tensors)


def qwen3_like(total: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 tensors with Qwen3 names/shapes (hidden 1024, MLP 3072, vocab 32000), about ``total`` elements."""
    h, inter, vocab, kv = 1024, 3072, 32000, 256
    gen = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": (vocab, h)}
    per_layer = h * h * 2 + kv * h * 2 + 3 * h * inter + 2 * h
    layers = max(1, int((total - 2 * vocab * h) / per_layer))
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (vocab, h)
    return {n: torch.randn(s, generator=gen) * 0.02 for n, s in out.items()}


def receiver_main(conn, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """A receiver process: answers engine endpoints sent over ``conn`` until told to stop."""
    from raygym.weightsync.codec import dtype_from_name
    from raygym.weightsync.receiver import WeightReceiver
    from raygym.weightsync.transport_dist import broadcast

    torch.set_num_threads(1)
    model = NamedTensors({n: torch.zeros(s, dtype=dtype_from_name(d)) for n, (s, d) in shapes.items()})
    receiver = WeightReceiver(model, timeout_s=300)
    while True:
        endpoint, payload = conn.recv()
        if endpoint == "stop":
            return
        try:
            if endpoint == "raw_broadcast":  # the baseline: one contiguous buffer, no decoding
                buf = torch.empty(payload["nbytes"], dtype=torch.uint8)
                broadcast(receiver.groups[payload["group_name"]], buf, 300)
                answer = {"success": True}
            else:
                answer = getattr(receiver, endpoint)(**payload)
        except Exception as exc:  # reported to the sender, which names this receiver
            answer = {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        conn.send(answer)


class PipeEngineLink:
    """EngineLink to a receiver process over a multiprocessing pipe."""

    def __init__(self, conn, name: str):
        self.conn, self.name = conn, name

    def call(self, endpoint, payload, timeout):
        if endpoint == "init_weights_update_group":
            payload = {**payload, "protocol": GROUP_PROTOCOL}
        self.conn.send((endpoint, payload))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer to {endpoint} in {timeout}s")
        return self.conn.recv()


def emit(figure: str, value: float, baseline: float | None = None, unit: str = "s", **extra) -> None:
    row = {"figure": figure, "value": round(value, 6), "unit": unit}
    if baseline is not None:
        row.update(baseline=round(baseline, 6), ratio=round(baseline / value if unit == "s" else value / baseline, 4)
                   if value else None)
    row.update(extra)
    row["machine"] = {"cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__,
                      "platform": platform.platform()}
    print(json.dumps(row), flush=True)


def main() -> None:
    from raygym.weightsync.codec import ENCODINGS, encode_delta
    from raygym.weightsync.sender import SenderSpec, WeightSender
    from raygym.weightsync.transport_dist import broadcast

    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--receivers", type=int, default=2)
    args = ap.parse_args()

    master = qwen3_like(args.params)
    params = [torch.nn.Parameter(t) for t in master.values()]
    names = list(master)
    v0 = {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params, strict=True)}
    total_bytes = sum(t.numel() * 2 for t in v0.values())
    numel = sum(t.numel() for t in v0.values())

    # one real AdamW step at the RL learning rate (random gradients), then the bf16 weights engines serve
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    v1 = {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params, strict=True)}
    del opt, params

    # physical reference: memcpy of the same bytes
    src = torch.empty(total_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy_s = time.perf_counter() - t0
    emit("memcpy_same_bytes", memcpy_s, bytes=total_bytes, gbps=total_bytes / 1e9 / memcpy_s)
    del dst

    # payload sizes per encoding (delta vs full bytes)
    changed = 0
    for enc in ENCODINGS:
        t0 = time.perf_counter()
        size = sum(len(encode_delta(v1[n], v0[n], enc)) for n in names)
        emit(f"payload_bytes_delta_over_full[{enc}]", size / total_bytes, unit="ratio", encode_s=time.perf_counter() - t0,
             goal="<= 0.06 for indices at lr 1e-6" if enc == "indices" else None)
    changed = sum(int((v1[n].view(torch.int16) != v0[n].view(torch.int16)).sum()) for n in names)
    emit("changed_fraction", changed / numel, unit="fraction", params=numel, lr=args.lr)

    ctx = mp.get_context("spawn")
    shapes = {n: (tuple(t.shape), "bfloat16") for n, t in v0.items()}
    procs, links = [], []
    for i in range(args.receivers):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=receiver_main, args=(b, shapes), daemon=True)
        proc.start()
        procs.append(proc)
        links.append(PipeEngineLink(a, f"receiver{i}"))
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="raygym-bench-")
    bucket = int(args.bucket_mb * 1024 * 1024)
    try:
        def sender(transport: str, mode: str) -> WeightSender:
            s = WeightSender(SenderSpec(engines=links, transport=transport, mode=mode, encoding="indices",
                                        buffer_size=bucket, timeout_s=300, disk_dir=disk_dir,
                                        master_address="127.0.0.1", backend="gloo", group_protocol=GROUP_PROTOCOL))
            s.setup()
            return s

        def timed_push(s: WeightSender, version: int, weights: dict[str, torch.Tensor]) -> tuple[float, dict]:
            t0 = time.perf_counter()
            result = s.push(version, weights.items())
            s.commit(version)
            return time.perf_counter() - t0, result["metrics"]

        # gloo: raw broadcast of one contiguous buffer (baseline) vs full sync, then delta vs full
        gloo = sender("nccl", "delta")
        flat = torch.empty(total_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        futures = [gloo.transport._pool.submit(link.call, "raw_broadcast",
                                               {"group_name": gloo.transport.group_name, "nbytes": total_bytes}, 300)
                   for link in links]
        broadcast(gloo.transport._pg, flat, 300)
        for f in futures:
            assert f.result()["success"]
        raw_s = time.perf_counter() - t0
        del flat
        emit("gloo_raw_broadcast_one_buffer", raw_s, memcpy_s, gbps=total_bytes / 1e9 / raw_s,
             note="ratio = memcpy / this")
        full_s, full_m = timed_push(gloo, 1, v0)  # first push of a delta sender is full (seeds the snapshot)
        emit("gloo_full_sync", full_s, raw_s, bytes=full_m["sync/bytes"], note="ratio = raw broadcast / full (goal >= 0.8)")
        delta_s, delta_m = timed_push(gloo, 2, v1)
        emit("gloo_delta_sync", delta_s, full_s, unit="s", bytes=delta_m["sync/bytes"],
             changed_frac=delta_m["sync/changed_frac"], encode_s=delta_m["sync/encode_s"],
             note="ratio = full / delta; time delta/full = 1/ratio (goal <= 0.5)", delta_over_full=delta_s / full_s)
        gloo.close()

        disk = sender("disk", "delta")
        dfull_s, _ = timed_push(disk, 1, v0)
        emit("disk_full_sync", dfull_s, None, dir=disk_dir)
        ddelta_s, dm = timed_push(disk, 2, v1)
        emit("disk_delta_sync", ddelta_s, dfull_s, bytes=dm["sync/bytes"], delta_over_full=ddelta_s / dfull_s,
             note="ratio = full / delta; goal delta/full <= 0.25")
        disk.close()
    finally:
        for link in links:
            link.conn.send(("stop", {}))
        for proc in procs:
            proc.join(timeout=30)
        if not args.disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
