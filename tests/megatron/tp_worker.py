"""One rank of a Megatron backend check (started by conftest.run_ranks with torchrun env vars).

Writes ``<out>.rank<R>.json`` with what the test asserts on: HF -> Megatron -> HF byte mismatches,
the largest log-prob difference to the HF model, and (``--train``) the effect of one train step.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")


def sample_batch(vocab: int, seed: int):
    from raygym.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (3, 4), (9, 2), (4, 11), (6, 6), (2, 9)]  # (prompt, response) lengths
    tokens = [torch.randint(2, vocab, (p + r,), generator=g) for p, r in shapes]
    masks = [torch.ones(r) for _, r in shapes]
    masks[1][0] = 0.0  # one token the policy did not produce
    return TrainBatch(tokens=tokens, prompt_lengths=[p for p, _ in shapes], response_lengths=[r for _, r in shapes],
                      loss_masks=masks, rewards=[float(i % 2) for i in range(len(shapes))], group_size=2)


def hf_log_probs(model_dir: str, batch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for t, r in zip(batch.tokens, batch.response_lengths, strict=True):
            logits = model(t[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, t[1:, None])[:, 0]
            out.append(lp[-r:])
    return out


def check_model(model_dir: str, tp: int, train: bool) -> dict:
    from safetensors.torch import load_file

    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.trainer.backend import TrainerSettings
    from raygym.trainer.megatron_backend import MegatronBackend

    # one optimizer step of the 6 samples (3 groups of 2) on tp ranks, all of them tensor parallel
    recipe = Recipe(trainer_backend="megatron", actor_num_gpus_per_node=tp, tensor_model_parallel_size=tp,
                    rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=6, lr=1e-3, weight_decay=0.0,
                    max_tokens_per_gpu=32, rollout_temperature=1.0, qkv_format="bshd", distributed_timeout_minutes=2)
    cfg = TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=model_dir, dtype="float32"))
    backend = MegatronBackend(TrainerSettings.from_config(cfg))
    result: dict = {"facts": backend.init()}

    original = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = dict(backend.iter_hf_weights())
    result["missing"] = sorted(set(original) - set(exported))
    result["extra"] = sorted(set(exported) - set(original))
    result["mismatched"] = sorted(
        n for n in set(original) & set(exported)
        if original[n].shape != exported[n].shape or not torch.equal(original[n].view(torch.uint8), exported[n].view(torch.uint8))
    )
    result["n_tensors"] = len(exported)

    batch = sample_batch(int(backend.shape.vocab_size), seed=1)
    ours = backend.compute_log_probs(batch)["log_probs"]
    ref = hf_log_probs(model_dir, batch)
    result["lengths_ok"] = all(a.shape == b.shape for a, b in zip(ours, ref, strict=True))
    result["logprob_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(ours, ref, strict=True))

    if train:
        from raygym.algo import group_advantages

        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size)
        batch.old_log_probs = ours
        batch.advantages = [torch.full((r,), float(a)) for r, a in zip(batch.response_lengths, adv, strict=True)]
        metrics = backend.train_step(batch, rollout_id=0)
        after = dict(backend.iter_hf_weights())
        new_lp = backend.compute_log_probs(batch)["log_probs"]

        # What the step should raise: the advantage-weighted log-likelihood of the trained tokens.
        def objective(lps):
            return sum(float((lp * m).sum() * a) for lp, m, a in zip(lps, batch.loss_masks, adv, strict=True))

        result["train_metrics"] = metrics
        result["changed_tensors"] = sum(not torch.equal(exported[n], after[n]) for n in exported)
        result["objective_before"], result["objective_after"] = objective(ours), objective(new_lp)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True, help="KIND=DIR; KIND 'dense' also trains with --train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--train", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for spec in args.model:
        kind, model_dir = spec.split("=", 1)
        results[kind] = check_model(model_dir, args.tp, args.train and kind == "dense")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    from raygym.trainer.megatron_backend import shutdown_parallel_state

    shutdown_parallel_state()


if __name__ == "__main__":
    main()
