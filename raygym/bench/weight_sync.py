"""Weight-sync benchmark: a ~100M-parameter Qwen3 model trained for real, pushed to 2 receivers.

The trainer side is a real ``Qwen3ForCausalLM`` (HF init: std 0.02, norms at 1.0, tied embeddings)
with fp32 master weights stepped by ``torch.optim.AdamW`` at the recipe's defaults (lr 1e-6, betas
0.9/0.98, weight decay 0.1) on a next-token loss over random tokens. Warm-up steps first, so Adam's
moments are realistic; then the engines get the bf16 cast of the weights after each further step.

Receivers are separate processes running raygym's engine-side code (``WeightReceiver`` +
``load_payload``: group join, pipelined broadcast receive, decode, apply, checksums) without an HTTP
server (``weight_sync_receivers.py``). Sections, one JSON object per line (figure, value, baseline
measured in the same run, ratio with its definition in ``ratio_is``, goal, machine with its load):

1. payloads: changed fraction per step, delta/full payload per encoding;
2. loopback: full sync (the sender's push) against a raw gloo broadcast of the same bytes; the same plus
   the coordinator's checksum verification (``gloo_full_sync_verified``). After the first full sync the
   receivers take full buckets in place (:mod:`raygym.weightsync.in_place`);
3. per link (loopback; then, as root, receivers in a network namespace behind a veth pair shaped with
   tc to ``--link-gbit`` rates, ``shaped_link.py``): ``--syncs`` syncs through ``WeightSync.push``
   (pause, push, checksum verification, commit, continue) with ``update_weight_mode`` full, delta and
   auto, each mode with its own receivers, interleaved sync by sync against load drift; delta/full and
   auto/(better fixed mode) time ratios;
4. serving: a real raygym server generating continuously while it receives syncs, with and without
   double buffering; the rollout pause per sync (``weight_sync_serving.py``).

    raygym bench weight_sync [--syncs 12] [--link-gbit 10 1] [--cache-dir DIR] [--skip serving]
                                     [--hidden 768 --layers 12 --vocab 32000] [--warm-steps 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from raygym.bench.common import figure_row
from raygym.bench.weight_sync_trainer import BenchTrainer, ping_pong
from raygym.engine_api.protocol import Endpoint, ShadowBegin, ShadowSwitch, WeightsChecksum

MACHINE = {"cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__, "platform": platform.platform()}
MODES = ("full", "delta", "auto")


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


def trained_versions(args) -> tuple[list[dict[str, torch.Tensor]], float, object]:
    """The engine weights after the warm-up steps and after each measured step (cached in ``--cache-dir``)."""
    from safetensors.torch import load_file, save_file

    key = f"v{args.hidden}-{args.intermediate}-{args.layers}-{args.vocab}-{args.lr}-{args.warm_steps}-{args.steps}"
    cache = os.path.join(args.cache_dir, key) if args.cache_dir else ""
    model = build_model(args)
    if cache and os.path.exists(os.path.join(cache, "DONE")):
        return [load_file(os.path.join(cache, f"{i}.safetensors")) for i in range(args.steps + 1)], 0.0, model.config
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
    if cache:
        os.makedirs(cache, exist_ok=True)
        for i, v in enumerate(versions):
            save_file(v, os.path.join(cache, f"{i}.safetensors"))
        open(os.path.join(cache, "DONE"), "w").close()
    return versions, train_s, model.config


# --------------------------------------------------------------------------- output


def emit(figure: str, value: float, unit: str = "s", baseline: float | None = None, ratio: float | None = None,
         ratio_is: str | None = None, goal: str | None = None, **extra) -> None:
    print(json.dumps(figure_row(figure, value, {**MACHINE, "load_avg_1m": round(os.getloadavg()[0], 2)}, unit, baseline, ratio, ratio_is, goal, **extra)),
          flush=True)


def _breakdown(m: dict[str, float]) -> dict[str, Any]:
    keys = ("sync/bytes", "sync/changed_frac", "sync/encode_s", "sync/transfer_s", "sync/wait_s", "sync/apply_s",
            "sync/buckets")
    return {k.removeprefix("sync/"): m[k] for k in keys if k in m}


# --------------------------------------------------------------------------- measurements


def memcpy_seconds(nbytes: int) -> float:
    """Best of 3 copies of ``nbytes`` between buffers that already exist (torch's threaded copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


_RAW: dict[int, torch.Tensor] = {}


def raw_broadcast(sender, links, nbytes: int, piece: int) -> float:
    """Seconds to broadcast ``nbytes`` (in ``piece``-byte broadcasts) over the sender's group: no
    packing, no checksums, no loading — the baseline the transport is held against. The buffers exist
    already on both sides (as the transport's do)."""
    from raygym.weightsync.transport_dist import broadcast

    if nbytes not in _RAW:
        _RAW[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
    flat = _RAW[nbytes]
    t0 = time.perf_counter()
    futures = [sender.transport._pool.submit(link.call, "raw_broadcast", {
        "group_name": sender.transport.group_name, "nbytes": nbytes, "piece": piece}, 300) for link in links]
    for start in range(0, nbytes, piece):
        broadcast(sender.transport._pg, flat[start : start + piece], 300)
    for f in futures:
        assert f.result()["success"], f.result()
    return time.perf_counter() - t0


def paired_median(baselines: list[float], measured: list[float]) -> float:
    """Median over repetitions of baseline_i / measured_i: each pair ran back to back, so load drift between
    repetitions cancels (best-of-both compares two extremes that may come from different moments)."""
    return statistics.median(b / m for b, m in zip(baselines, measured, strict=True))


def make_sender(links, mode: str, master: str, bucket: int):
    from raygym.weightsync.sender import SenderSpec, WeightSender

    s = WeightSender(SenderSpec(engines=links, transport="nccl", mode=mode, encoding="indices", buffer_size=bucket,
                                timeout_s=300, master_address=master, backend="gloo"))
    s.setup()
    return s


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) used so far by this process and ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def measured(fn, pids: list[int]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and ``pids``) of ``fn()``."""
    c0, t0 = cpu_seconds(pids), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds(pids) - c0


def transport_figures(versions, rx, rx_shadow, args, memcpy_s: float) -> None:
    """Full sync (the sender's push, commit included) against raw gloo broadcasts of the same bytes; also
    double-buffered (shadow begin, push into the shadow, switch) to receivers of their own (every update
    they get is double-buffered, as in a run). Wall seconds (noisy on a shared machine) and CPU seconds of
    the sender and the receivers (what one host's cores must do per sync)."""
    from raygym.weightsync.codec import checksum

    links, pids = rx.links, [p.pid for p in rx.procs]
    shadow_links, shadow_pids = rx_shadow.links, [p.pid for p in rx_shadow.procs]

    total = sum(t.numel() * t.element_size() for t in versions[0].values())
    want = {n: checksum(t) for n, t in versions[0].items()}
    bucket = int(args.bucket_mb * 1024 * 1024)
    sender = make_sender(links, "full", "127.0.0.1", bucket)
    shadow_sender = make_sender(shadow_links, "full", "127.0.0.1", bucket)
    try:
        piece = sender.bucket_bytes()
        # (wall seconds, the sync's metrics) per repetition
        runs_one: list[tuple[float, dict]] = []
        runs_pieces: list[tuple[float, dict]] = []
        fulls: list[tuple[float, dict]] = []
        shadowed: list[tuple[float, dict]] = []
        cpu: dict[str, list[float]] = {"raw_one": [], "raw_pieces": [], "full": [], "shadowed": []}
        metrics: dict[int, dict] = {}
        verify: dict[str, list[float]] = {"full": [], "shadowed": []}

        def push(version: int, shadow: bool) -> None:
            out, to = (shadow_sender, shadow_links) if shadow else (sender, links)
            if shadow:
                for link in to:
                    assert link.call(Endpoint.RAYGYM_SHADOW_BEGIN, ShadowBegin(full=True), 300)["success"]
            metrics[version] = out.push(version, versions[0].items())["metrics"]
            if shadow:
                for link in to:
                    assert link.call(Endpoint.RAYGYM_SHADOW_SWITCH, ShadowSwitch(weight_version=str(version)), 300)["success"]
            out.commit(version)

        # warm-up (not timed): buffers allocated and pages touched once, as in a run with many syncs
        raw_broadcast(sender, links, total, total)
        push(1, False)
        push(99, True)  # the shadow copy is allocated on its first use
        for rep in range(2, args.reps + 2):  # interleaved, so load changes hit all four alike
            for key, out, fn in (("raw_one", runs_one, lambda: raw_broadcast(sender, links, total, total)),
                                 ("raw_pieces", runs_pieces, lambda: raw_broadcast(sender, links, total, piece)),
                                 ("full", fulls, lambda rep=rep: push(rep, False)),
                                 ("shadowed", shadowed, lambda rep=rep: push(100 + rep, True))):
                wall, used = measured(fn, shadow_pids if key == "shadowed" else pids)
                cpu[key].append(used)
                out.append((wall, metrics.get(100 + rep if key == "shadowed" else rep, {})))
                if key in ("full", "shadowed"):  # timed apart: the coordinator's check, every engine at once
                    to = shadow_links if key == "shadowed" else links
                    t0 = time.perf_counter()
                    answers = list(sender.transport._pool.map(
                        lambda link: link.call(Endpoint.RAYGYM_WEIGHTS_CHECKSUM, WeightsChecksum(names=None), 300)["checksums"], to))
                    verify[key].append(time.perf_counter() - t0)
                    for link, got in zip(to, answers, strict=True):
                        assert got == want, f"{link.name} differs after a {key} sync"
        raws_one = [w for w, _ in runs_one]
        raws_pieces = [w for w, _ in runs_pieces]
    finally:
        sender.close()
        shadow_sender.close()
    raw_one, raw_pieces = min(raws_one), min(raws_pieces)
    full_s, full_m = min(fulls, key=lambda r: r[0])
    emit("memcpy_same_bytes", memcpy_s, bytes=total, gbps=total / 1e9 / memcpy_s)
    emit("gloo_raw_broadcast_one_buffer", raw_one, baseline=memcpy_s, ratio=memcpy_s / raw_one,
         ratio_is="memcpy / this", gbps=total / 1e9 / raw_one, receivers=len(links), reps=raws_one)
    emit("gloo_raw_broadcast_bucket_pieces", raw_pieces, baseline=raw_one, ratio=raw_one / raw_pieces,
         ratio_is="one buffer / pieces", piece_bytes=piece, reps=raws_pieces)
    emit("gloo_full_sync", full_s, baseline=raw_one, ratio=raw_one / full_s,
         ratio_is="raw one-buffer broadcast / full sync (best of reps)", goal=">= 0.8",
         ratio_vs_raw_pieces=raw_pieces / full_s,
         median_ratio=statistics.median(raws_one) / statistics.median(r[0] for r in fulls),
         paired_median_ratio=paired_median(raws_one, [r[0] for r in fulls]),
         reps=[r[0] for r in fulls], **_breakdown(full_m))
    verified = [w + v for (w, _), v in zip(fulls, verify["full"], strict=True)]
    emit("gloo_full_sync_verified", min(verified), baseline=raw_one, ratio=raw_one / min(verified),
         ratio_is="raw one-buffer broadcast / (full sync + the coordinator's checksum verification)",
         median_ratio=statistics.median(raws_one) / statistics.median(verified),
         verify_s=statistics.median(verify["full"]), reps=verified)
    shadow_s, shadow_m = min(shadowed, key=lambda r: r[0])
    emit("gloo_full_sync_double_buffered", shadow_s, baseline=raw_one, ratio=raw_one / shadow_s,
         ratio_is="raw one-buffer broadcast / double-buffered full sync (shadow begin + push + switch)",
         goal=">= 0.8", ratio_vs_raw_pieces=raw_pieces / shadow_s,
         median_ratio=statistics.median(raws_one) / statistics.median(r[0] for r in shadowed),
         paired_median_ratio=paired_median(raws_one, [r[0] for r in shadowed]),
         reps=[r[0] for r in shadowed],
         **_breakdown(shadow_m))
    med = {k: statistics.median(v) for k, v in cpu.items()}
    for key in ("full", "shadowed"):
        emit(f"cpu_seconds_{'full_sync' if key == 'full' else 'full_sync_double_buffered'}", med[key],
             baseline=med["raw_pieces"], ratio=med["raw_pieces"] / med[key],
             ratio_is="CPU seconds of a raw bucket-piece broadcast / of this sync (sender + receivers, median of reps)",
             raw_one_buffer_cpu_s=med["raw_one"], reps=cpu[key])


def make_sync(mode: str, versions, links, args, schedule: list[int], master: str):
    """A connected WeightSync in ``mode`` whose trainer pushes the seed (wire version 1) and then one
    ``schedule`` entry per sync."""
    from raygym.config import Recipe
    from raygym.weightsync.coordinator import WeightSync

    recipe = Recipe(update_weight_mode=mode, update_weight_transport="nccl", update_weight_encoding="indices",
                    update_weight_buffer_size=int(args.bucket_mb * 1024 * 1024), update_weight_timeout=300.0,
                    colocate=False)
    trainer = BenchTrainer(versions)
    trainer.schedule = {1: 0, **{i + 2: v for i, v in enumerate(schedule)}}
    sync = WeightSync(recipe, [trainer], links, spec_overrides={"master_address": master, "backend": "gloo"})
    sync.setup()
    return sync


def link_modes(label: str, versions, receiver_sets, args, master: str) -> dict[str, float]:
    """Full, delta and auto over one link, each with its own receivers, interleaved sync by sync (the
    order rotates every sync) so that load changes on this shared machine hit the three alike."""
    schedule = ping_pong(args.steps, args.syncs)
    syncs = {mode: make_sync(mode, versions, rx.links, args, schedule, master)
             for mode, rx in zip(MODES, receiver_sets, strict=True)}
    per_sync: dict[str, list[float]] = {m: [] for m in MODES}
    metrics: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for sync in syncs.values():
            sync.push(1)  # seeds engines and snapshot; not counted (identical in every mode)
        for i, wire in enumerate(range(2, len(schedule) + 2)):
            for mode in MODES[i % 3:] + MODES[: i % 3]:
                t0 = time.perf_counter()
                m = syncs[mode].push(wire)
                per_sync[mode].append(time.perf_counter() - t0)
                metrics[mode].append(m)
                assert m["sync/full_resyncs"] == 0.0, f"{label} {mode}: a sync failed verification"
    finally:
        for sync in syncs.values():
            sync.shutdown()
    totals = {m: sum(per_sync[m]) for m in MODES}
    n = len(schedule)
    best = min(totals["full"], totals["delta"])
    emit(f"{label}_full_sync_mean", totals["full"] / n, syncs=n, per_sync=per_sync["full"])
    emit(f"{label}_delta_sync_mean", totals["delta"] / n, baseline=totals["full"] / n,
         ratio=totals["delta"] / totals["full"], ratio_is="delta / full", per_sync=per_sync["delta"],
         goal="<= 0.15" if label == "1gbit" else None)
    auto = metrics["auto"]
    errors = [abs(m["sync/predicted_s"] - m["sync/measured_s"]) / m["sync/measured_s"]
              for m in auto if "sync/predicted_s" in m]
    medians = {m: statistics.median(per_sync[m]) for m in MODES}
    emit(f"{label}_auto_sync_mean", totals["auto"] / n, baseline=best / n, ratio=totals["auto"] / best,
         ratio_is="auto / better fixed mode", goal="<= 1.10", better_fixed="full" if best == totals["full"] else "delta",
         median_ratio=medians["auto"] / min(medians["full"], medians["delta"]),
         modes_chosen="".join("D" if m["sync/mode"] == 1.0 else "F" for m in auto), per_sync=per_sync["auto"],
         prediction_error_mean=sum(errors) / len(errors) if errors else None)
    return totals


# --------------------------------------------------------------------------- main


def main() -> None:
    from raygym.bench import shaped_link
    from raygym.bench.weight_sync_receivers import Receivers
    from raygym.weightsync.codec import ENCODINGS, encode_delta

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="trained steps after the warm-up (syncs cycle through them)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=float, default=512,
                    help="update_weight_buffer_size in MiB (the recipe's default; capped on gloo as in a run)")
    ap.add_argument("--reps", type=int, default=16, help="repetitions of the full sync and raw baselines (interleaved)")
    ap.add_argument("--syncs", type=int, default=20, help="measured syncs per mode and link (after a seeding one)")
    ap.add_argument("--link-gbit", type=float, nargs="*", default=[10.0, 1.0])
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--cache-dir", default="", help="keep the trained versions here (skips training next time)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["loopback", "links", "serving"])
    ap.add_argument("--serving-syncs", type=int, default=4)
    args = ap.parse_args()

    versions, train_s, config = trained_versions(args)
    v0 = versions[0]
    names = list(v0)
    numel = sum(t.numel() for t in v0.values())
    total_bytes = numel * 2
    emit("model", float(numel), unit="params", bytes=total_bytes, tensors=len(names), train_s=train_s,
         warm_steps=args.warm_steps, steps=args.steps, lr=args.lr)
    memcpy_s = memcpy_seconds(total_bytes)

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
             encode_s=time.perf_counter() - t0, payload_bytes=size)

    shapes = {n: (tuple(t.shape), "bfloat16") for n, t in v0.items()}
    if "loopback" not in args.skip:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        sets = [Receivers(args.receivers, shapes, ifname="lo", tag=f"lo{m}") for m in MODES]
        try:
            transport_figures(versions, sets[0], sets[1], args, memcpy_s)
            link_modes("loopback", versions, sets, args, "127.0.0.1")
        finally:
            for rx in sets:
                rx.close()
    if "links" not in args.skip and args.link_gbit:
        why = shaped_link.available()
        if why:
            emit("shaped_links_skipped", 0.0, unit="", reason=why)
        else:
            with shaped_link.ShapedLink() as link:
                os.environ["GLOO_SOCKET_IFNAME"] = link.host_if
                sets = [Receivers(args.receivers, shapes, netns=link.netns_path, ifname=link.ns_if, tag=f"ns{m}")
                        for m in MODES]
                try:
                    for gbit in args.link_gbit:
                        shaping = link.set_rate_gbit(gbit)
                        sender = make_sender(sets[0].links, "full", link.host_ip, int(args.bucket_mb * 1024 * 1024))
                        try:
                            raw = min(raw_broadcast(sender, sets[0].links, total_bytes, sender.bucket_bytes())
                                      for _ in range(2))
                        finally:
                            sender.close()
                        label = f"{gbit:g}gbit"
                        emit(f"{label}_raw_broadcast", raw, gbps_per_receiver=total_bytes * 8 / 1e9 / raw,
                             shaping=shaping)
                        link_modes(label, versions, sets, args, link.host_ip)
                finally:
                    for rx in sets:
                        rx.close()
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if "serving" not in args.skip:
        from raygym.bench.weight_sync_serving import serving_pause

        serving_pause(versions, config, args, emit)


if __name__ == "__main__":
    main()
