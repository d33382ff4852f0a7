"""One phase of the reshard check (started by test_reshard.py through spawn_ranks, 1 or 2 ranks).

``--phase first`` (1 rank): train a step, save checkpoint ``a``, then train steps 1-2.
``--phase reshard`` (2 ranks: FSDP2 for torch, TP=2 for Megatron): load ``a``, save it again as ``b``, then
train steps 1-2. ``--phase back`` (1 rank): load ``b`` (written by 2 ranks), train steps 1-2.
Each phase writes ``<dir>/<phase>.json`` (rank 0): the metrics of steps 1-2 and a digest of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
from trainer_setup import make_batch

warnings.filterwarnings("ignore")


def main() -> None:
    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.trainer import TrainerActor, TrainerSettings

    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--phase", required=True, choices=("first", "reshard", "back"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    tp = world if args.backend == "megatron" else 1
    recipe = Recipe(
        trainer_backend=args.backend, actor_num_gpus_per_node=world, colocate=False, rollout_num_gpus=world,
        tensor_model_parallel_size=tp, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4,
        lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=8, weight_decay=0.01,
        max_tokens_per_gpu=48, seed=7, distributed_timeout_minutes=5,
    )
    settings = TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=args.model)))
    actor = TrainerActor(settings=settings)
    actor.init()
    batch = make_batch(seed=5)
    root = Path(args.dir)
    if args.phase == "first":
        actor.train_step(batch.with_log_probs(actor.compute_log_probs(batch)).with_advantages("grpo"), 0)
        actor.save_checkpoint(0, extra={"phase": "first"}, save_dir=str(root / "a"))
    else:
        actor.load_checkpoint(str(root / ("a" if args.phase == "reshard" else "b")))
        if args.phase == "reshard":
            actor.save_checkpoint(0, extra={"phase": "reshard"}, save_dir=str(root / "b"))
    fixed = batch.with_log_probs(actor.compute_log_probs(batch)).with_advantages("grpo")
    steps = [{k: v for k, v in actor.train_step(fixed, i).items() if not k.startswith("perf/")} for i in (1, 2)]
    weights = {n: t for n, t in actor.backend.iter_hf_weights()}
    if int(os.environ["RANK"]) == 0:
        digest = {n: float(t.double().sum()) for n, t in weights.items()}
        torch.save(weights, root / f"{args.phase}.weights.pt")
        (root / f"{args.phase}.json").write_text(json.dumps({"steps": steps, "digest": digest}))


if __name__ == "__main__":
    main()
