"""Skipping the old-log-prob pass (one optimizer step per rollout) changes neither the loss nor the update."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_torch_backend import params_of
from trainer_setup import make_batch, settings_for, trainer_settings

from raygym.trainer import TrainerSettings
from raygym.trainer.torch_backend import TorchBackend, has_active_dropout, reuses_current_log_probs

# 2 prompts x 4 samples = one optimizer step of 8: the single-pass case
ONE_STEP = dict(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8)


def grpo_settings(path: str, **overrides) -> TrainerSettings:
    # SGD: Adam's first step (g / |g|) would amplify float noise; wide clip bounds are not needed (ratio 1)
    return settings_for(path, optimizer="sgd", lr=0.5, max_tokens_per_gpu=40, **{**ONE_STEP, **overrides})


def test_which_settings_make_the_old_pass_redundant():
    assert reuses_current_log_probs(trainer_settings("m", **ONE_STEP))
    for change in (
        {"global_batch_size": 4},  # two optimizer steps: the second one's old policy is not the current one
        {"use_kl_loss": True},
        {"kl_coef": 0.1},
        {"advantage_estimator": "ppo", "use_critic": True},  # PPO (which needs its critic)
        {"use_critic": True},
        {"custom_megatron_before_log_prob_hook": "pkg.mod:fn"},
    ):
        assert not reuses_current_log_probs(trainer_settings("m", **{**ONE_STEP, **change})), change


def test_tis_keeps_the_single_pass():
    """TIS weighs the trainer's pre-update log-probs against the engine's: the detached current ones serve."""
    assert reuses_current_log_probs(trainer_settings("m", **ONE_STEP, use_tis=True))


def test_dropout_rules_the_single_pass_out(tiny_model_path):
    backend = TorchBackend(grpo_settings(tiny_model_path))
    assert backend.init()["single_pass_log_probs"] is True
    assert not has_active_dropout(backend.model)
    backend.model.config.attention_dropout = 0.1
    assert has_active_dropout(backend.model)


def loss_and_grads(backend: TorchBackend, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole-step loss (summed over micro-batches) and the accumulated gradient, without stepping."""
    backend.model.train()
    backend.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for idx in backend._micro_batches(batch):
        loss, _ = backend._micro_batch_loss(batch.select(idx), False, len(batch), batch.num_loss_tokens())
        loss.backward()
        total = total + loss.detach()
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    backend.optimizer.zero_grad(set_to_none=True)
    return total, grads


def test_single_pass_loss_and_gradient_equal_the_two_pass_ones(tiny_model_path):
    backend = TorchBackend(grpo_settings(tiny_model_path))
    backend.init()
    batch = make_batch(seed=3).with_advantages("grpo")
    assert len(backend._micro_batches(batch)) > 1  # accumulation over several micro-batches is covered
    two_pass = batch.with_log_probs(backend.compute_log_probs(batch))
    loss_two, grads_two = loss_and_grads(backend, two_pass)
    loss_one, grads_one = loss_and_grads(backend, batch)  # old_log_probs None: the detached current ones
    assert loss_two.abs() > 0 and len(grads_two) == len(list(backend.model.parameters()))
    assert torch.equal(loss_one, loss_two)
    assert grads_one.keys() == grads_two.keys()
    for name in grads_two:
        assert grads_two[name].abs().sum() > 0, name
        assert torch.equal(grads_one[name], grads_two[name]), name


@pytest.mark.parametrize("groups", [2, 4])  # 4 groups = 2 optimizer steps: train_step must fall back
def test_train_step_without_old_log_probs_matches_the_two_pass_step(tiny_model_path, groups):
    one, two = TorchBackend(grpo_settings(tiny_model_path)), TorchBackend(grpo_settings(tiny_model_path))
    one.init()
    two.init()
    batch = make_batch(seed=5, groups=groups).with_advantages("grpo")
    before = params_of(one)
    m_one = one.train_step(batch, 0)
    m_two = two.train_step(batch.with_log_probs(two.compute_log_probs(batch)), 0)
    assert m_one["train/optimizer_steps"] == groups // 2
    for key in ("train/pg_loss", "train/entropy", "train/clipfrac", "train/approx_kl", "train/grad_norm"):
        assert m_one[key] == m_two[key], key
    after_one, after_two = params_of(one), params_of(two)
    assert not torch.equal(after_one["lm_head.weight"], before["lm_head.weight"])
    for name in after_two:
        assert torch.equal(after_one[name], after_two[name]), name


def test_tis_train_step_without_the_old_pass_matches_the_two_pass_step(tiny_model_path):
    """Fully asynchronous training (TIS on): the engine's log-probs, made by older weights, differ from the
    trainer's; the single pass gives the same corrections, loss and update as a separate old-log-prob pass."""
    settings = grpo_settings(tiny_model_path, use_tis=True, tis_clip=1.5)
    one, two = TorchBackend(settings), TorchBackend(settings)
    one.init()
    two.init()
    base = make_batch(seed=9).with_advantages("grpo")
    rng = torch.Generator().manual_seed(0)
    own = one.compute_log_probs(base)["log_probs"]  # the engine's = the trainer's, shifted as stale ones are
    batch = replace(base, rollout_log_probs=[lp + 0.4 * torch.randn(lp.shape, generator=rng) for lp in own])
    m_one = one.train_step(batch, 0)
    m_two = two.train_step(batch.with_log_probs(two.compute_log_probs(batch)), 0)
    assert 0 < m_one["train/tis_clipped_frac"] < 1  # the weights are not all 1: the correction is exercised
    for key in ("train/pg_loss", "train/tis_weight", "train/tis_clipped_frac", "train/grad_norm"):
        assert m_one[key] == m_two[key], key
    for name, value in params_of(two).items():
        assert torch.equal(params_of(one)[name], value), name
