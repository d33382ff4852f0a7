"""Checkpoint memory and time: sharded (every rank writes its own FSDP2 shards with
torch.distributed.checkpoint, ``raygym.checkpoint.sharded``) against the former gather-and-pickle path
(the full model and optimizer state gathered to rank 0, pickled by ``raygym.checkpoint.store.save_checkpoint``;
loaded on rank 0 and broadcast), same model, same run.

The model is the builtin tiny Qwen3 scaled up to ~100M parameters (fp32, AdamW state: ~1.2 GB of training
state in all), trained by the torch backend at world sizes 1, 2 and 4 (gloo, one process per rank).

Figures, per world size (``max`` over ranks):
- ``save_peak_mb``: peak host memory of a rank while saving, above what the process held before the model
  was built (after imports and joining the process group): the rank's training state plus whatever the
  save adds; goal for the sharded save:
  <= 1.2 x (1/world) of the world-1 figure (``ratio_to_world1`` vs ``goal``).
- ``save_added_mb``: what the save itself adds on top of the training state.
- ``save_s`` / ``load_s``: wall time of a save / a load (slowest rank; the best of ``--repeats``),
  sharded vs gather-and-pickle (``ratio`` = sharded / gather). The sharded writer fsyncs its files; the
  pickle path never did.

    raygym bench checkpoint [--worlds 1 2 4] [--layers 16] [--repeats 2]

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def machine() -> dict:
    return {"cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "device": "cpu", "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> float:
    """Give freed heap back to the OS, reset the peak-RSS mark (VmHWM) to now; returns the RSS (MB)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_mb("VmRSS")


def build_model(directory: Path, layers: int) -> tuple[str, int]:
    """A Qwen3 of the builtin tokenizer scaled to ``layers`` x (hidden 768, MLP 2048): ~6.3M params a layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from raygym.builtin import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3Config(vocab_size=len(tok), hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory), sum(p.numel() for p in model.parameters())


# ---- one rank ---------------------------------------------------------------------------------------
def gather_and_pickle_save(backend, url: str) -> None:
    """The former path: full state gathered to rank 0 (CPU offload), pickled there."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from raygym.checkpoint.store import capture_rng_state, save_checkpoint

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model: dict[str, Any] = get_model_state_dict(backend.model, options=opts)  # full, on the CPU: tensors
    optim: dict[str, Any] = get_optimizer_state_dict(backend.model, backend.optimizer, options=opts)
    if backend.rank == 0:
        save_checkpoint(url, 0, model_state=model, optimizer_state=optim,
                        trainer_state={"schedule": backend.schedule.state_dict(), "rng": capture_rng_state()})


def gather_and_pickle_load(backend, url: str) -> None:
    """The former path: rank 0 reads the whole checkpoint, then broadcasts it into every rank's shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from raygym.checkpoint.store import load_checkpoint

    sharded = backend.world_size > 1
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=sharded)
    ckpt = load_checkpoint(saved(url)) if backend.rank == 0 or not sharded else None
    model: dict[str, Any] = ckpt.model_state if ckpt else {}
    optim: dict[str, Any] = (ckpt.optimizer_state or {}) if ckpt else {}
    set_model_state_dict(backend.model, model, options=opts)
    set_optimizer_state_dict(backend.model, backend.optimizer, optim, options=opts)
    if sharded:
        dist.barrier()


def saved(url: str) -> str:
    """The path of the checkpoint just saved under ``url``."""
    from raygym.checkpoint.store import latest_checkpoint

    latest = latest_checkpoint(url)
    assert latest is not None, f"no checkpoint under {url}"
    return latest.path


def sharded_save(backend, url: str) -> None:
    from raygym.checkpoint.sharded import save_sharded

    save_sharded(url, 0, backend.checkpoint_state(include_optimizer=True), rank=backend.rank,
                 world_size=backend.world_size)


def sharded_load(backend, url: str) -> None:
    from raygym.checkpoint.sharded import load_sharded

    template = backend.checkpoint_state(include_optimizer=True)
    backend.load_checkpoint_state(load_sharded(saved(url), template, rank=backend.rank,
                                               world_size=backend.world_size))


def worker(model_dir: str, out_dir: str, repeats: int) -> None:
    import torch.distributed as dist
    from transformers import Qwen3ForCausalLM  # noqa: F401  (the code, not the state, before the baseline)

    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.trainer import TrainerSettings
    from raygym.trainer.torch_backend import TorchBackend

    if int(os.environ["WORLD_SIZE"]) > 1:  # joining the world is not training state: before the baseline
        dist.init_process_group("gloo")
    base_rss = reset_peak()
    recipe = Recipe(actor_num_gpus_per_node=int(os.environ["WORLD_SIZE"]), lr=1e-4, weight_decay=0.0,
                    distributed_timeout_minutes=30)
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=model_dir))
    backend = TorchBackend(TrainerSettings.from_config(cfg))
    backend.init()
    backend.checkpoint_state(include_optimizer=True)  # creates the (sharded) AdamW state, as a step would
    world = backend.world_size

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    def measure(fn, url: str) -> dict:
        barrier()
        before = reset_peak()
        t0 = time.perf_counter()
        fn(backend, url)
        barrier()
        seconds = time.perf_counter() - t0
        peak = status_mb("VmHWM")
        return {"s": seconds, "peak_mb": peak - base_rss, "added_mb": peak - before}

    out: dict[str, dict] = {}
    for _ in range(repeats):
        for path in ("sharded", "gather"):
            url = os.path.join(out_dir, path)
            save, load = (sharded_save, sharded_load) if path == "sharded" else (gather_and_pickle_save, gather_and_pickle_load)
            for op, fn in (("save", save), ("load", load)):
                got, best = measure(fn, url), out.get(f"{path}_{op}")
                out[f"{path}_{op}"] = got if best is None else {
                    "s": min(got["s"], best["s"]), "peak_mb": max(got["peak_mb"], best["peak_mb"]),
                    "added_mb": max(got["added_mb"], best["added_mb"])}
            barrier()
            if backend.rank == 0:
                shutil.rmtree(url)
    everyone: list[dict[str, dict] | None] = [out]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, out)
    if backend.rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(everyone))
    if world > 1:
        dist.destroy_process_group()


# ---- the driver -------------------------------------------------------------------------------------
def run_world(world: int, model_dir: str, scratch: Path, repeats: int) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = scratch / f"world{world}"
    out_dir.mkdir()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "raygym.bench.checkpoint", "--worker", model_dir, str(out_dir),
                                       "--repeats", str(repeats)], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"world {world}: ranks exited with {codes}")
    return json.loads((out_dir / "result.json").read_text())


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT_DIR"))
    args = ap.parse_args()
    if args.worker:
        model_dir, out_dir = args.worker
        worker(model_dir, out_dir, args.repeats)
        return
    info = machine()
    with tempfile.TemporaryDirectory(prefix="raygym-bench-ckpt-") as scratch:
        model_dir, n_params = build_model(Path(scratch, "model"), args.layers)
        emit(figure="model", params=n_params, fp32_state_mb=round(n_params * 4 * 3 / 2**20), machine=info)
        results = {w: run_world(w, model_dir, Path(scratch), args.repeats) for w in args.worlds}
    base = max(r["sharded_save"]["peak_mb"] for r in results[min(results)])
    for world, ranks in results.items():
        worst = {k: {m: max(r[k][m] for r in ranks) for m in ("s", "peak_mb", "added_mb")} for k in ranks[0]}
        peak = worst["sharded_save"]["peak_mb"]
        emit(figure="sharded_save_peak_mb_per_rank", world=world, value=round(peak, 1), baseline_world1=round(base, 1),
             ratio_to_world1=round(peak / base, 3), goal=round(1.2 / world, 3), met=peak / base <= 1.2 / world,
             added_mb=round(worst["sharded_save"]["added_mb"], 1), machine=info)
        gather = worst["gather_save"]["peak_mb"]
        emit(figure="gather_pickle_save_peak_mb_per_rank", world=world, value=round(gather, 1),
             added_mb=round(worst["gather_save"]["added_mb"], 1), sharded=round(peak, 1),
             ratio_sharded_to_gather=round(peak / gather, 3), machine=info)
        for op in ("save", "load"):
            s, g = worst[f"sharded_{op}"]["s"], worst[f"gather_{op}"]["s"]
            emit(figure=f"{op}_time_s", world=world, sharded=round(s, 3), gather_pickle=round(g, 3),
                 ratio=round(s / g, 3), machine=info)


if __name__ == "__main__":
    main()
