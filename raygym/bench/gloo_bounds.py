"""How close to a raw gloo broadcast a full sync can get on this machine: lower bounds, no raygym protocol.

Three processes on loopback (a sender and two receivers, like ``weight_sync.py``), ~200 MB in tensors of
``--tensor-mb``, buckets of ``--bucket-mb``. Each variant does strictly less work than a verified full sync,
so raw / variant bounds what ``gloo_full_sync`` can reach here:

- ``raw``: the bytes broadcast from one prepared buffer in bucket-sized pieces (the baseline);
- ``pack``: the sender copies the tensors into two alternating bucket buffers (bucket k+1 packed while k is
  on the wire), receivers receive in place; no hashing anywhere;
- ``pack_hash``: as ``pack``, the sender hashing while it copies (xxh3 per tensor, in cache) and the receivers
  hashing what they received (what verification costs);
- ``per_tensor``: no packing: one asynchronous broadcast per tensor, straight from and into the tensors.

    raygym bench gloo_bounds [--reps 8] [--bucket-mb 32] [--tensor-mb 1.33]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash

TOTAL = 200_000_000
CHUNK = 1 << 20
VARIANTS = ("raw", "pack", "pack_hash", "per_tensor")


def copy_hashing(out: np.ndarray, src: np.ndarray) -> str:
    state = xxhash.xxh3_64()
    for i in range(0, src.size, CHUNK):
        np.copyto(out[i : i + CHUNK], src[i : i + CHUNK])
        state.update(out[i : i + CHUNK].data)
    return state.hexdigest()


def plan_buckets(sizes: list[int], bucket: int) -> list[list[tuple[int, int, int]]]:
    """(tensor index, offset in bucket, bytes) per bucket, filled in order."""
    plan: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if current and used + n > bucket:
            plan.append(current)
            current, used = [], 0
        current.append((i, used, n))
        used += n
    return [*plan, current]


def worker(rank: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=120))
    count = max(1, round(TOTAL / (args.tensor_mb * 1e6)))
    sizes = [TOTAL // count] * count
    plan = plan_buckets(sizes, int(args.bucket_mb * 2**20))
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    flat = torch.cat(tensors)  # the receivers' weights laid out like the buckets; the sender's raw buffer
    buffers = [torch.empty(int(args.bucket_mb * 2**20), dtype=torch.uint8) for _ in range(2)]
    sender_pool = ThreadPoolExecutor(1)

    def run(variant: str) -> None:
        base = 0
        if variant == "per_tensor":
            works = [dist.broadcast(tensors[i] if rank == 0 else flat[sum(sizes[:i]) : sum(sizes[: i + 1])], 0,
                                    async_op=True) for i in range(count)]
            for work in works:
                work.wait()
            return
        pending = None
        for k, entries in enumerate(plan):
            used = entries[-1][1] + entries[-1][2]
            if variant == "raw":
                dist.broadcast(flat[base : base + used], 0)
            elif rank == 0:
                buf = buffers[k % 2]
                for i, off, n in entries:
                    if variant == "pack_hash":
                        copy_hashing(buf[off : off + n].numpy(), tensors[i].numpy())
                    else:
                        np.copyto(buf[off : off + n].numpy(), tensors[i].numpy())
                if pending is not None:
                    pending.result()
                pending = sender_pool.submit(dist.broadcast, buf[:used], 0)
            else:
                region = flat[base : base + used]
                dist.broadcast(region, 0)
                if variant == "pack_hash":
                    for _, off, n in entries:
                        xxhash.xxh3_64_hexdigest(region[off : off + n].numpy().data)
            base += used
        if pending is not None:
            pending.result()

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:  # warm-up
        run(variant)
    for _ in range(args.reps):  # interleaved, so load drift hits every variant alike
        for variant in VARIANTS:
            dist.barrier()
            start = time.perf_counter()
            run(variant)
            dist.barrier()
            times[variant].append(time.perf_counter() - start)
    if rank == 0:
        raw = min(times["raw"])
        for variant in VARIANTS:
            best = min(times[variant])
            out.put({"figure": f"gloo_bound_{variant}", "value": round(best, 6), "unit": "s", "baseline": round(raw, 6),
                     "ratio": round(raw / best, 4), "ratio_is": "raw broadcast / this (best of reps)",
                     "median_ratio": round(statistics.median(times["raw"]) / statistics.median(times[variant]), 4),
                     "bytes": TOTAL, "tensors": count, "buckets": len(plan), "receivers": 2,
                     "machine": {"cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}})
        out.put(None)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=32.0)
    ap.add_argument("--tensor-mb", type=float, default=1.33)
    args = ap.parse_args()
    from raygym.weightsync.transport_dist import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=worker, args=(rank, port, args, out)) for rank in range(3)]
    for proc in procs:
        proc.start()
    while (row := out.get(timeout=900)) is not None:
        print(json.dumps(row), flush=True)
    for proc in procs:
        proc.join(timeout=60)


if __name__ == "__main__":
    main()
