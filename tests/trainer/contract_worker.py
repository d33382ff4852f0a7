"""One run of the trainer-backend contract (started by test_backend_contract.py through spawn_ranks).

For every ``--model KIND=DIR`` it drives ``TrainerActor`` on ``--backend`` (torch or megatron) with a KL
loss against a reference model, and writes ``<out>/<backend>_<KIND>.json`` with what the tests assert:
log-probs against a plain HF forward, train metrics, the reference staying put, save -> load -> the next
steps, and HF exports. Megatron's parallel state is process-global, hence a process of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch
from trainer_setup import hf_log_probs, make_batch

warnings.filterwarnings("ignore")


def recipe_for(backend: str, save: str):
    from raygym.config import Recipe

    return Recipe(
        trainer_backend=backend, actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1,
        rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4, lr=1e-3, min_lr=1e-5,
        lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=8, weight_decay=0.01, use_kl_loss=True,
        kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01, max_tokens_per_gpu=48, seed=7, save=save,
        distributed_timeout_minutes=5,
    )


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def exported_log_probs(directory: str, batch) -> list[torch.Tensor]:
    return hf_log_probs(directory, batch)


def check(backend: str, kind: str, model_dir: str, out: Path) -> dict:
    from raygym.checkpoint.state import CheckpointState
    from raygym.checkpoint.store import export_hf, load_checkpoint
    from raygym.config import ModelConfig, TrainConfig
    from raygym.trainer import TrainerActor, TrainerSettings
    from raygym.trainer.contract import LogProbResult

    rank = int(os.environ["RANK"])
    work = out / f"{backend}_{kind}"
    cfg = TrainConfig(recipe=recipe_for(backend, str(work / "ckpt")), model=ModelConfig(hf_checkpoint=model_dir))
    settings = TrainerSettings.from_config(cfg)
    res: dict = {}
    a = TrainerActor(settings=settings)
    res["facts"] = {k: v for k, v in a.init().items() if isinstance(v, (str, int, float, bool))}
    batch = make_batch(seed=4)  # 8 samples: 2 optimizer steps of 4 per train_step

    first = a.compute_log_probs(batch)
    res["result_type"] = type(first).__name__
    res["result_keys"] = sorted(first)
    res["lengths_ok"] = [t.numel() for t in first["log_probs"]] == batch.response_lengths
    res["logprob_vs_hf"] = max_diff(first["log_probs"], hf_log_probs(model_dir, batch))
    res["ref_equals_policy_at_start"] = max_diff(first["ref_log_probs"], first["log_probs"])
    res["log_probs"] = [t.tolist() for t in first["log_probs"]]

    res["metrics0"] = a.train_step(batch.with_log_probs(first).with_advantages("grpo"), 0)
    url = a.save_checkpoint(0, extra={"data_index": 8}, save_dir=str(work / "ckpt"))
    after = a.compute_log_probs(batch)
    res["ref_moved"] = max_diff(after["ref_log_probs"], first["ref_log_probs"])
    res["policy_moved"] = max_diff(after["log_probs"], first["log_probs"])
    fixed = batch.with_log_probs(after).with_advantages("grpo")
    res["next_a"] = [a.train_step(fixed, i) for i in (1, 2)]
    weights_a = {n: t for n, t in a.backend.iter_hf_weights()}
    direct = a.export_hf(str(work / "hf_direct"))
    final_a = a.compute_log_probs(batch)["log_probs"]

    b = TrainerActor(settings=settings)
    b.init()
    info = b.load_checkpoint(str(work / "ckpt"))
    res["loaded"] = {"rollout_id": info["rollout_id"], "start": info["start_rollout_id"], "extra": info["extra"]}
    loaded_lp = b.compute_log_probs(batch)
    res["loaded_equals_saved"] = max_diff(loaded_lp["log_probs"], after["log_probs"])
    res["loaded_ref_equals_ref"] = max_diff(loaded_lp["ref_log_probs"], first["ref_log_probs"])
    res["next_b"] = [b.train_step(fixed, i) for i in (1, 2)]

    # off-policy corrections (IcePop's token mask): a fresh trainer whose old policy is ``first``; the
    # rollout log-probs are the trainer's, moved by a seeded noise, so some ratios leave the band
    tis_recipe = cfg.recipe.replace(use_tis=True, tis_mode="mask", tis_clip_low=0.8, tis_clip=1.25)
    tis_cfg = TrainConfig(recipe=tis_recipe, model=cfg.model)
    c = TrainerActor(settings=TrainerSettings.from_config(tis_cfg))
    c.init()
    noise = torch.Generator().manual_seed(3)
    rollout = [lp + 0.3 * torch.randn(lp.shape, generator=noise) for lp in first["log_probs"]]
    off_policy = dataclasses.replace(batch, rollout_log_probs=rollout).with_log_probs(first).with_advantages("grpo")
    res["metrics_tis"] = c.train_step(off_policy, 0)
    weights_b = {n: t for n, t in b.backend.iter_hf_weights()}
    if rank == 0:
        res["weights_identical"] = weights_a.keys() == weights_b.keys() and all(
            torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
        res["export_direct_vs_backend"] = max_diff(exported_log_probs(direct, batch), final_a)
        via = export_hf(url, str(work / "hf_ckpt"))
        res["export_ckpt_vs_saved"] = max_diff(exported_log_probs(via, batch), after["log_probs"])
        whole = load_checkpoint(url)
        res["checkpoint_has_optimizer"] = whole.optimizer_state is not None and bool(whole.optimizer_state["state"])
        res["checkpoint_tensor_names"] = sorted(whole.model_state)
        res["template_type"] = type(a.backend.checkpoint_state(include_optimizer=False)).__name__
    assert isinstance(first, LogProbResult) and CheckpointState is not None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--model", action="append", required=True, help="KIND=DIR")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    for spec in args.model:
        kind, model_dir = spec.split("=", 1)
        res = check(args.backend, kind, model_dir, out)
        if int(os.environ["RANK"]) == 0:
            (out / f"{args.backend}_{kind}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
