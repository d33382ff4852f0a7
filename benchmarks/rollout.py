"""Generated tokens/s through EngineActor + raygym's server vs the same model's HF ``generate``.

Both sides run the same prompts greedily for the same number of new tokens (eos ignored) on the
same device and thread count. The server side sends every prompt as its own concurrent request
(as the rollout manager does) through ``EngineActor.generate``; the baseline calls
``model.generate`` once on the whole left-padded batch in this process. The ratio
server/baseline is the figure; the goal is overhead < 20% (ratio > 0.8).

    python benchmarks/rollout.py [--prompts 64] [--new-tokens 8] [--models tiny,10m] [--repeats 3]

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from raygym.builtin import TINY_MODEL, build_tokenizer, materialize_model, next_digit_rows  # noqa: E402
from raygym.presets import tiny  # noqa: E402
from raygym.rollout.engine import EngineActor  # noqa: E402

# ~10M parameters: 10 layers of hidden 256 / MLP 1024 on the builtin character vocabulary.
ARCHS = {
    "tiny": {},
    "10m": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
    },
}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    tok = build_tokenizer()
    rng = random.Random(seed)
    return [tok.encode("q" * rng.randrange(0, 24) + row["prompt"]) for row in next_digit_rows(n, seed)]


def baseline_seconds(model, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return elapsed


def server_seconds(
    actor: EngineActor, pool: ThreadPoolExecutor, prompts: list[list[int]], new_tokens: int
) -> float:
    def one(p: list[int]) -> int:
        out = actor.generate(
            {
                "input_ids": p,
                "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            }
        )
        return out["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    produced = sum(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * new_tokens
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--models", default="tiny,10m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.prompts)
    workdir = tempfile.mkdtemp(prefix="raygym-bench-")
    machine = {
        "cores": os.cpu_count(),
        "device": args.device,
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
    }
    for name in args.models.split(","):
        path = materialize_model(TINY_MODEL, Path(workdir) / name, seed=0, **ARCHS[name])
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
        params = sum(p.numel() for p in model.parameters())
        actor = EngineActor(
            tiny().replace(seed=0, sglang_max_running_requests=args.prompts),
            0,
            path,
            [],
            "127.0.0.1",
            "raygym",
            device=args.device,
            extra_server_args=["--num-threads", str(args.threads)],
        )
        actor.start()
        pool = ThreadPoolExecutor(args.prompts)
        try:
            baseline_seconds(model, prompts, args.new_tokens)  # warm-up both sides
            server_seconds(actor, pool, prompts, args.new_tokens)
            base, served = [], []
            for _ in range(args.repeats):  # interleaved so machine load hits both alike
                base.append(baseline_seconds(model, prompts, args.new_tokens))
                served.append(server_seconds(actor, pool, prompts, args.new_tokens))
            stats = actor.call("stats")
        finally:
            pool.shutdown()
            actor.close()
        tokens = args.prompts * args.new_tokens
        tps_server, tps_base = tokens / statistics.median(served), tokens / statistics.median(base)
        print(
            json.dumps(
                {
                    "figure": "rollout_generated_tokens_per_s",
                    "model": name,
                    "params": params,
                    "prompts": args.prompts,
                    "new_tokens": args.new_tokens,
                    "value": round(tps_server, 1),
                    "baseline": round(tps_base, 1),
                    "baseline_name": "hf_generate_one_batch_in_process",
                    "ratio": round(tps_server / tps_base, 3),
                    "overhead_pct": round(100 * (tps_base / tps_server - 1), 1),
                    "server_max_batch_size": stats["max_batch_size"],
                    "server_batches": stats["batches"],
                    "seconds_server": [round(s, 4) for s in served],
                    "seconds_baseline": [round(s, 4) for s in base],
                    "machine": machine,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
