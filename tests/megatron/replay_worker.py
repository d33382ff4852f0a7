"""One rank of the Megatron routing-replay check (started by conftest.run_ranks with torchrun env vars).

Reads ``--case`` (a torch file: the batch, the routes to replay and the torch backend's log-probs under them),
runs the Megatron backend at the given layout with ``use_rollout_routing_replay``, and writes
``<out>.rank<R>.json``: the largest log-prob difference to the torch backend with and without replay, and the
replay tallies of a train step under replay (``--train``).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--train", action="store_true")
    args = ap.parse_args()
    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.trainer.backend import TrainerSettings
    from raygym.trainer.megatron_backend import MegatronBackend, shutdown_parallel_state

    world = int(os.environ["WORLD_SIZE"])
    recipe = Recipe(trainer_backend="megatron", actor_num_gpus_per_node=world, tensor_model_parallel_size=args.tp,
                    expert_model_parallel_size=args.ep, rollout_batch_size=3,
                    n_samples_per_prompt=2, global_batch_size=6, lr=1e-3, weight_decay=0.0, max_tokens_per_gpu=32,
                    rollout_temperature=1.0, qkv_format="bshd", distributed_timeout_minutes=2,
                    use_rollout_routing_replay=True)
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=args.model, dtype="float32"))
    backend = MegatronBackend(TrainerSettings.from_config(cfg))
    facts = backend.init()
    case = torch.load(args.case, weights_only=False)
    free, forced = case["batch"], case["forced"]

    def diff(ours, ref) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(ours, ref, strict=True))

    result = {"facts": facts,
              "free_diff": diff(backend.compute_log_probs(free).log_probs, case["free_log_probs"]),
              "forced_diff": diff(backend.compute_log_probs(forced).log_probs, case["forced_log_probs"]),
              "forced_vs_free": diff(case["forced_log_probs"], case["free_log_probs"])}
    if args.train:
        backend.replay.tally.metrics()  # count the train step's forwards only
        forced.old_log_probs = case["forced_log_probs"]
        forced.advantages = [torch.full((r,), 1.0 if i % 2 else -1.0) for i, r in enumerate(forced.response_lengths)]
        result["train_metrics"] = backend.train_step(forced, rollout_id=0)
    with open(f"{args.out}.rank{int(os.environ['RANK'])}.json", "w") as f:
        json.dump(result, f)
    shutdown_parallel_state()


if __name__ == "__main__":
    main()
