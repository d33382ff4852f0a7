"""Adapter-only weight sync into raygym's server: a real torch trainer rank training peft adapters, a real server
subprocess holding adapters beside its base weights (``--lora-config``), the coordinator's protocol. Only adapter
tensors travel (full or delta, over the gloo group or the disk), every one is verified by checksum on the engine,
and the engine then generates with exactly the trainer's log-probs."""

from __future__ import annotations

import httpx
import pytest
import torch

from raygym.config import ModelConfig, Recipe, TrainConfig
from raygym.engines.launch.lora import engine_lora_args
from raygym.lora import LoraSpec, adapter_config, model_targets
from raygym.trainer import TrainBatch, TrainerActor, TrainerSettings
from raygym.types import Sample
from raygym.weightsync.coordinator import WeightSync
from tests.weightsync.raygym_servers import raygym_servers

SPEC = LoraSpec(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))
ADAPTER_TENSORS = 2 * 3 * 2  # layers x targeted modules x (A, B)


def lora_recipe(**over) -> Recipe:
    return Recipe(actor_num_gpus_per_node=1, colocate=False, rollout_num_gpus=1, rollout_engine="raygym",
                  lora_rank=SPEC.rank, lora_alpha=int(SPEC.alpha), lora_target_modules="q_proj,v_proj,down_proj",
                  lr=2e-2, weight_decay=0.0, global_batch_size=8, rollout_batch_size=2, n_samples_per_prompt=4,
                  update_weight_timeout=120.0, **over)


def trainer_rank(model_path: str, recipe: Recipe) -> TrainerActor:
    actor = TrainerActor(settings=TrainerSettings.from_config(TrainConfig(
        recipe=recipe, model=ModelConfig(hf_checkpoint=model_path))))
    actor.init()
    return actor


def train_once(actor: TrainerActor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    samples = [Sample(prompt="p", prompt_tokens=[5, 6, 7], group_index=i // 4, sample_index=i % 4,
                      response_tokens=torch.randint(2, 40, (6,), generator=gen).tolist(), loss_mask=[1] * 6,
                      reward=float(i % 2)) for i in range(8)]
    batch = TrainBatch.from_samples(samples, group_size=4)
    batch = batch.with_log_probs(actor.compute_log_probs(batch)).with_advantages("grpo")
    actor.train_step(batch, 0)


def engine_log_probs(url: str, prompt: list[int], response: list[int]) -> list[float]:
    from raygym.engine_api.auth import auth_headers

    answer = httpx.post(f"{url}/generate", json={
        "input_ids": prompt + response, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True, "logprob_start_len": len(prompt) - 1}, headers=auth_headers(), timeout=60).json()
    return [float(entry[0]) for entry in answer["meta_info"]["input_token_logprobs"][1:]]


@pytest.mark.parametrize("transport, mode", [("nccl", "full"), ("nccl", "delta"), ("disk", "auto")])
def test_only_adapters_travel_and_are_verified_by_checksum(tiny_model_path, tmp_path, transport, mode):
    recipe = lora_recipe(update_weight_transport=transport, update_weight_mode=mode,
                         update_weight_disk_dir=str(tmp_path / "sync") if transport == "disk" else "")
    targets = model_targets(tiny_model_path, SPEC)
    server_args = engine_lora_args("raygym", SPEC, targets)
    if transport == "disk":
        server_args += ["--weight-source", str(tmp_path / "sync")]
    trainer = trainer_rank(tiny_model_path, recipe)
    with raygym_servers(tiny_model_path, 1, "float32", extra_args=server_args) as urls:
        sync = WeightSync(recipe, [trainer], urls, engine_kind="raygym",
                          spec_overrides={"adapter_config": adapter_config(SPEC, tiny_model_path, targets)})
        sync.setup()
        try:
            rows = []
            for version in (1, 2, 3):
                train_once(trainer, seed=version)
                rows.append(sync.push(version))
        finally:
            sync.shutdown()
        adapter_bytes = sum(t.numel() * 4 for _, t in trainer.backend.iter_hf_weights())
        for row in rows:
            assert row["sync/verified_tensors"] == ADAPTER_TENSORS and row["sync/full_resyncs"] == 0
            assert row["sync/raw_bytes"] == adapter_bytes  # the adapters, never the base model
        if mode == "delta":
            assert [r["sync/mode"] for r in rows] == [0.0, 1.0, 1.0]  # the first push seeds the snapshot
        prompt, response = [5, 6, 7, 8], [9, 10, 11, 12, 13]
        expected = trainer.probe_log_probs([prompt], [response])[0]
        got = engine_log_probs(urls[0], prompt, response)
        assert got == pytest.approx(expected, abs=1e-5)  # the engine serves the trainer's adapters exactly
        base = trainer_rank(tiny_model_path, lora_recipe()).probe_log_probs([prompt], [response])[0]
        assert max(abs(a - b) for a, b in zip(got, base, strict=True)) > 1e-3  # and they changed something
