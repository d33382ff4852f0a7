"""The torch trainer backend on CPU with the builtin tiny Qwen3: learning, FSDP2 equivalence, resume, export."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from trainer_setup import free_port, join_local_world, make_batch, settings_for

from raygym.trainer import TrainBatch, TrainerActor, TrainerSettings
from raygym.trainer.torch_backend import TorchBackend


def prepared(backend: TorchBackend, batch: TrainBatch) -> TrainBatch:
    return batch.with_log_probs(backend.compute_log_probs(batch)).with_advantages("grpo")


def params_of(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.iter_hf_weights()}


def test_loss_decreases_on_a_fixed_batch(tiny_model_path):
    # Clip bounds that never bind (ratio in (0, 101]) turn the clipped surrogate into plain policy gradient,
    # so the loss must fall.
    backend = TorchBackend(settings_for(tiny_model_path, eps_clip=1.0, eps_clip_high=100.0, lr=3e-3))
    backend.init()
    batch = prepared(backend, make_batch())
    losses = [backend.train_step(batch, rollout_id=i)["train/pg_loss"] for i in range(6)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_metrics_gradient_accumulation_and_frozen_params(tiny_model_path):
    batch = make_batch(seed=1)
    # Same batch trained as one micro-batch and as many tiny ones: same update (exact global denominators).
    # SGD, because Adam's first step (g / |g|) amplifies float noise in near-zero gradients.
    common = dict(
        optimizer="sgd", lr=0.5, freeze_params_name_list=[r"embed_tokens"], calculate_per_token_loss=True
    )
    one = TorchBackend(settings_for(tiny_model_path, max_tokens_per_gpu=10_000, **common))
    many = TorchBackend(
        settings_for(tiny_model_path, use_dynamic_batch_size=False, micro_batch_size=1, **common)
    )
    info = one.init()
    many.init()
    assert info["frozen"] == ["model.embed_tokens.weight"]
    assert all(
        p is not one.model.model.embed_tokens.weight for g in one.optimizer.param_groups for p in g["params"]
    )
    before = params_of(one)
    b1, b2 = prepared(one, batch), prepared(many, batch)
    m1 = one.train_step(b1, 0)
    m2 = many.train_step(b2, 0)
    for key in ("train/pg_loss", "train/entropy", "train/clipfrac", "train/approx_kl", "train/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    p1, p2 = params_of(one), params_of(many)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-5, atol=1e-7)
    assert torch.equal(p1["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(p1["lm_head.weight"], before["lm_head.weight"])
    assert m1["perf/train_tokens"] == sum(batch.total_lengths())
    assert m1["train/lr"] == pytest.approx(0.5)


def test_log_probs_match_a_direct_forward_at_temperature(tiny_model_path):
    backend = TorchBackend(settings_for(tiny_model_path, rollout_temperature=0.7, max_tokens_per_gpu=20))
    backend.init()
    batch = make_batch(seed=2)
    got = backend.compute_log_probs(batch)["log_probs"]
    for i in range(len(batch)):
        with torch.no_grad():
            logits = backend.model(input_ids=batch.tokens[i][None]).logits[0].float() / 0.7
        p, r = batch.prompt_lengths[i], batch.response_lengths[i]
        expected = (
            torch.log_softmax(logits[p - 1 : p + r - 1], -1).gather(-1, batch.tokens[i][p:, None]).squeeze(-1)
        )
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-5)


def _fsdp_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    from torch.distributed.tensor import DTensor

    from raygym.checkpoint.sharded import load_sharded, save_sharded
    from raygym.checkpoint.store import load_checkpoint

    join_local_world(rank, world, port)
    backend = TorchBackend(
        settings_for(path, lr=1e-4, max_tokens_per_gpu=30, balance_data=True, distributed_timeout_minutes=2,
                     actor_num_gpus_per_node=world)
    )
    backend.init()
    metrics = backend.train_step(prepared(backend, make_batch(seed=3)), rollout_id=0)
    weights = {n: t for n, t in backend.iter_hf_weights()}
    # each rank's own FSDP shards (nothing gathered) go into a sharded checkpoint and come back
    state = backend.checkpoint_state(include_optimizer=True)
    assert all(isinstance(t, DTensor) and t.to_local().shape[0] < t.shape[0] for t in state.model.values()
               if t.dim() == 2)
    assert state.optimizer["state"].keys() >= {"lm_head.weight"}
    url = save_sharded(os.path.dirname(out) + "/ckpt", 0, state, rank=rank, world_size=world)
    for t in backend.model.parameters():
        torch.nn.init.zeros_(t.data.to_local() if isinstance(t.data, DTensor) else t.data)
    template = backend.checkpoint_state(include_optimizer=True)
    backend.load_checkpoint_state(load_sharded(url, template, rank=rank, world_size=world))
    reloaded = {n: t for n, t in backend.iter_hf_weights()}
    if rank == 0:
        assert all(torch.equal(reloaded[n], weights[n]) for n in weights)
        checkpoint = load_checkpoint(url).model_state  # read whole in one process, as export does
        torch.save({"weights": weights, "metrics": metrics, "checkpoint": checkpoint}, out)
    else:
        assert all(t is None for t in weights.values())
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # a separate process per rank
def test_two_fsdp_ranks_match_one_rank(tiny_model_path, tmp_path):
    out = str(tmp_path / "fsdp.pt")
    mp.start_processes(
        _fsdp_worker, args=(2, free_port(), tiny_model_path, out), nprocs=2, start_method="spawn"
    )
    two = torch.load(out, weights_only=True)
    single = TorchBackend(settings_for(tiny_model_path, lr=1e-4, max_tokens_per_gpu=30))
    single.init()
    metrics = single.train_step(prepared(single, make_batch(seed=3)), rollout_id=0)
    weights = params_of(single)
    assert weights.keys() == two["weights"].keys()
    assert all(torch.equal(two["checkpoint"][n], two["weights"][n]) for n in weights)
    for name, value in weights.items():
        other = two["weights"][name]
        assert (value - other).norm() <= 1e-5 * value.norm(), name
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
        assert two["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


def test_save_then_resume_is_bit_identical(tiny_model_path, tmp_path):
    batch = make_batch(seed=4)
    settings = dict(lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=6, min_lr=1e-5)
    first = TrainerActor(settings=settings_for(tiny_model_path, **settings))
    first.init()
    fixed = prepared(first.backend, batch)
    first.train_step(fixed, 0)
    path = first.save_checkpoint(0, extra={"data_index": 8}, save_dir=str(tmp_path / "ckpt"))
    assert path.endswith("iter_0000000")
    losses_a = [first.train_step(fixed, i)["train/pg_loss"] for i in (1, 2, 3)]
    lr_a = first.backend.schedule.current_lr()

    second = TrainerActor(settings=settings_for(tiny_model_path, **settings))
    second.init()
    loaded = second.load_checkpoint(str(tmp_path / "ckpt"))
    assert (
        loaded["rollout_id"] == 0 and loaded["start_rollout_id"] == 1 and loaded["extra"] == {"data_index": 8}
    )
    losses_b = [second.train_step(fixed, i)["train/pg_loss"] for i in (1, 2, 3)]
    assert losses_a == losses_b
    assert second.backend.schedule.current_lr() == lr_a
    pa, pb = params_of(first.backend), params_of(second.backend)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_hf_export_round_trip(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raygym.checkpoint.store import export_hf

    actor = TrainerActor(settings=settings_for(tiny_model_path))
    actor.init()
    actor.train_step(prepared(actor.backend, make_batch(seed=5)), 0)
    ids = make_batch(seed=6).tokens[0][None]
    with torch.no_grad():
        expected = actor.backend.model(input_ids=ids).logits
    direct = actor.export_hf(str(tmp_path / "hf"))
    actor.save_checkpoint(0, save_dir=str(tmp_path / "ckpt"))
    via_checkpoint = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf2"))
    for out in (direct, via_checkpoint):
        assert os.path.exists(os.path.join(out, "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, expected)
        assert AutoTokenizer.from_pretrained(out).encode("next:7") == AutoTokenizer.from_pretrained(
            tiny_model_path
        ).encode("next:7")


def test_settings_from_recipe_hooks_and_backend_choice(tiny_model_path):
    from raygym.config import ModelConfig, Recipe, TrainConfig
    from raygym.errors import ConfigError
    from raygym.trainer import choose_backend

    calls = []

    def hook(args, rollout_id, batch):
        calls.append((args, rollout_id, len(batch)))
        return batch.select(range(len(batch) - 1))  # a hook may replace the batch

    recipe = Recipe(
        lr=2e-3,
        eps_clip_high=0.3,
        global_batch_size=8,
        trainer_backend="auto",
        extra_config={"torch_activation_checkpointing": True},
        custom_megatron_before_log_prob_hook=hook,
    )
    settings = TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint=tiny_model_path)))
    assert (settings.lr, settings.torch_activation_checkpointing) == (2e-3, True)
    assert settings.eps_clip == 0.2 and settings.hf_checkpoint == tiny_model_path
    actor = TrainerActor(settings=settings)
    actor.init()
    assert actor.backend.loss_config.eps_clip_high == 0.3
    model = actor.backend.model
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    out = actor.compute_log_probs(make_batch(seed=8), rollout_id=3)
    assert calls == [(recipe, 3, 8)] and len(out["log_probs"]) == 7
    if not torch.cuda.is_available():
        assert choose_backend("auto") == "torch"
    with pytest.raises(ConfigError, match="trainer_backend"):
        choose_backend("jax")
