"""The PPO critic on the torch backend (CPU, builtin tiny Qwen3): learning, value alignment, the PPO step,
FSDP2 equivalence, checkpoint and export round trips."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from trainer_setup import free_port, join_local_world, make_batch, trainer_settings
from trainer_setup import settings_for as base_settings

from raygym.errors import ConfigError
from raygym.trainer import TrainBatch, TrainerActor, TrainerSettings
from raygym.trainer.actor import make_backend
from raygym.trainer.critic import TorchCriticBackend, load_value_model, value_clip_range
from raygym.trainer.torch_backend import TorchBackend


def settings_for(path: str, **overrides) -> TrainerSettings:
    return base_settings(path, **{"advantage_estimator": "ppo", "use_critic": True, **overrides})


def with_returns(critic, batch: TrainBatch) -> TrainBatch:
    """What the driver does for the critic: old values, then GAE advantages and returns."""
    return batch.with_log_probs(critic.compute_values(batch)).with_advantages("ppo", gamma=1.0, lambd=0.95)


def critic_params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.iter_hf_weights()}


def masked_mse(values: list[torch.Tensor], batch: TrainBatch) -> float:
    err = [
        ((v - r).square() * m).sum() for v, r, m in zip(values, batch.returns, batch.loss_masks, strict=True)
    ]
    return float(sum(err) / batch.num_loss_tokens())


def test_value_loss_decreases_on_a_fixed_batch(tiny_model_path):
    critic = TorchCriticBackend(settings_for(tiny_model_path, lr=1e-5, critic_lr=1e-3))
    info = critic.init()
    assert info["role"] == "critic" and info["lr"] == 1e-3 and not info["reference_model"]
    batch = make_batch()
    losses, mses, rounds = [], [], []
    for step in range(8):  # each step is a rollout: fresh old values, the same samples and rewards
        prepared = with_returns(critic, batch)
        rounds.append(prepared)
        mses.append(masked_mse(prepared.values, prepared))
        metrics = critic.train_step(prepared, rollout_id=step)
        losses.append(metrics["critic/value_loss"])
        assert metrics["critic/lr"] == pytest.approx(1e-3)
    assert losses[-1] < 0.5 * losses[0], losses
    assert mses[-1] < 0.5 * mses[0], mses
    # a fresh critic predicts exactly 0 (zero-initialised head)
    first = rounds[0]
    assert mses[0] == pytest.approx(masked_mse([torch.zeros_like(r) for r in first.returns], first))


def test_values_align_with_response_tokens_like_log_probs(tiny_model_path):
    critic = TorchCriticBackend(settings_for(tiny_model_path, max_tokens_per_gpu=20))
    critic.init()
    batch = make_batch(seed=2)
    fresh = critic.compute_values(batch)["values"]
    assert [v.shape for v in fresh] == [(n,) for n in batch.response_lengths]
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" and not v.any() for v in fresh)
    critic.train_step(with_returns(critic, batch), rollout_id=0)  # the head is no longer zero
    got = critic.compute_values(batch)["values"]
    for i in range(len(batch)):
        with torch.no_grad():
            direct = critic.model(input_ids=batch.tokens[i][None])[0]
        p, r = batch.prompt_lengths[i], batch.response_lengths[i]
        # the value of response token j is the state at position p-1+j, the one that generated it
        torch.testing.assert_close(got[i], direct[p - 1 : p + r - 1], rtol=1e-5, atol=1e-6)
    assert any(v.abs().max() > 1e-4 for v in got)


def test_critic_body_starts_from_the_policy_checkpoint(tiny_model_path):
    critic = TorchCriticBackend(settings_for(tiny_model_path))
    critic.init()
    actor = TorchBackend(settings_for(tiny_model_path))
    actor.init()
    policy = dict(actor.model.named_parameters())
    names = [n for n, _ in critic.model.named_parameters()]
    assert {"value_head.weight", "value_head.bias"} <= set(names) and "lm_head.weight" not in names
    for name, param in critic.model.named_parameters():
        if name.startswith("model."):
            assert torch.equal(param, policy[name]), name


def test_micro_batches_accumulate_to_the_same_update(tiny_model_path):
    batch = make_batch(seed=1)
    common = dict(optimizer="sgd", critic_lr=0.5, calculate_per_token_loss=True)
    one = TorchCriticBackend(settings_for(tiny_model_path, max_tokens_per_gpu=10_000, **common))
    many = TorchCriticBackend(
        settings_for(tiny_model_path, use_dynamic_batch_size=False, micro_batch_size=1, **common)
    )
    one.init()
    many.init()
    m1 = one.train_step(with_returns(one, batch), 0)
    m2 = many.train_step(with_returns(many, batch), 0)
    for key in ("critic/value_loss", "critic/value_clipfrac", "critic/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    p1, p2 = critic_params(one), critic_params(many)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-5, atol=1e-7)


def test_ppo_step_trains_actor_and_critic(tiny_model_path):
    """The per-step sequence the driver runs for advantage_estimator='ppo'."""
    actor = TrainerActor(settings=settings_for(tiny_model_path))
    critic = TrainerActor(settings=settings_for(tiny_model_path), role="critic")
    actor.init()
    critic.init()
    batch = make_batch(seed=3)
    for step in range(2):
        old = actor.compute_log_probs(batch, step)
        values = critic.compute_values(batch, step)
        ready = (
            batch.with_log_probs(old)
            .with_log_probs(values)
            .with_advantages("ppo", kl_coef=0.0, gamma=1.0, lambd=0.95)
        )
        for adv, ret, val, mask in zip(
            ready.advantages, ready.returns, ready.values, ready.loss_masks, strict=True
        ):
            torch.testing.assert_close(ret, adv + val * mask)
        actor_metrics = actor.train_step(ready, step)
        critic_metrics = critic.train_step(ready, step)
        assert "train/pg_loss" in actor_metrics and "critic/value_loss" in critic_metrics
        assert not (set(actor_metrics) & set(critic_metrics)), set(actor_metrics) & set(critic_metrics)
    # step 0 values were all zero; after one critic step the advantages use non-zero values
    assert any(v.abs().max() > 0 for v in ready.values)
    with pytest.raises(ConfigError, match="role='actor'"):
        actor.compute_values(batch)


def test_critic_errors_and_backend_choice(tiny_model_path):
    with pytest.raises(ConfigError, match="role='critic'"):
        TorchBackend(settings_for(tiny_model_path), role="critic")
    settings = settings_for(tiny_model_path)
    assert isinstance(make_backend("auto", settings, "critic"), TorchCriticBackend)
    assert type(make_backend("torch", settings, "actor")) is TorchBackend
    critic = TrainerActor(settings=settings, role="critic")
    critic.init()
    with pytest.raises(ConfigError, match="no returns"):
        critic.train_step(make_batch(), rollout_id=0)


def test_value_clip_comes_from_a_value_clip_field_else_eps_clip():
    assert value_clip_range(trainer_settings("m", eps_clip=0.3)) == 0.3
    assert value_clip_range(trainer_settings("m", eps_clip=0.3, value_clip=0.5)) == 0.5
    assert value_clip_range(trainer_settings("m", value_clip=0.0)) is None  # 0: no clipping


def _critic_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    join_local_world(rank, world, port)
    critic = TorchCriticBackend(
        settings_for(path, max_tokens_per_gpu=30, balance_data=True, distributed_timeout_minutes=2,
                     actor_num_gpus_per_node=world)
    )
    critic.init()
    batch = make_batch(seed=4)
    metrics = [critic.train_step(with_returns(critic, batch), rollout_id=i) for i in range(2)]
    values = critic.compute_values(batch)["values"]
    weights = dict(critic.iter_hf_weights())
    if rank == 0:
        torch.save({"weights": weights, "metrics": metrics, "values": values}, out)
    else:
        assert all(t is None for t in weights.values())
        torch.save({"values": values}, out + ".rank1")
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # a separate process per rank
def test_two_fsdp_critic_ranks_match_one_rank(tiny_model_path, tmp_path):
    out = str(tmp_path / "critic.pt")
    mp.start_processes(
        _critic_worker, args=(2, free_port(), tiny_model_path, out), nprocs=2, start_method="spawn"
    )
    two = torch.load(out, weights_only=True)
    rank1_values = torch.load(out + ".rank1", weights_only=True)["values"]
    single = TorchCriticBackend(settings_for(tiny_model_path, max_tokens_per_gpu=30))
    single.init()
    batch = make_batch(seed=4)
    metrics = [single.train_step(with_returns(single, batch), rollout_id=i) for i in range(2)]
    values = single.compute_values(batch)["values"]
    weights = critic_params(single)
    assert weights.keys() == two["weights"].keys()
    for name, value in weights.items():
        assert (value - two["weights"][name]).norm() <= 1e-5 * value.norm(), name
    for mine, theirs in zip(metrics, two["metrics"], strict=True):
        for key in ("critic/value_loss", "critic/grad_norm", "critic/value_mean"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5, abs=1e-7), key
    assert len(two["values"]) == len(batch)  # every rank returns the whole gathered batch
    for a, b, c in zip(values, two["values"], rank1_values, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert torch.equal(b, c)


def test_save_resume_and_export_round_trip(tiny_model_path, tmp_path):
    batch = make_batch(seed=5)
    first = TrainerActor(
        settings=settings_for(tiny_model_path, lr_decay_style="cosine", lr_decay_iters=5), role="critic"
    )
    first.init()
    first.train_step(with_returns(first.backend, batch), 0)
    path = first.save_checkpoint(0, extra={"data_index": 8}, save_dir=str(tmp_path / "ckpt"))
    assert path.endswith("/critic/iter_0000000")
    # the policy's checkpoint listing in the same directory does not see the critic's
    from raygym.checkpoint.store import latest_checkpoint

    assert latest_checkpoint(str(tmp_path / "ckpt")) is None
    losses_a = [first.train_step(with_returns(first.backend, batch), i)["critic/value_loss"] for i in (1, 2)]

    second = TrainerActor(
        settings=settings_for(tiny_model_path, lr_decay_style="cosine", lr_decay_iters=5), role="critic"
    )
    second.init()
    loaded = second.load_checkpoint(str(tmp_path / "ckpt"))
    assert loaded["rollout_id"] == 0 and loaded["extra"] == {"data_index": 8}
    losses_b = [
        second.train_step(with_returns(second.backend, batch), i)["critic/value_loss"] for i in (1, 2)
    ]
    assert losses_a == losses_b
    pa, pb = critic_params(first.backend), critic_params(second.backend)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)

    exported = second.export_hf(str(tmp_path / "hf-critic"))
    reloaded = load_value_model(exported, torch.device("cpu"))
    ids = batch.tokens[0][None]
    with torch.no_grad():
        expected = second.backend.model(input_ids=ids)
        assert expected.abs().max() > 1e-4 and torch.equal(reloaded(input_ids=ids), expected)
