"""Routing replay on the torch backend (raygym.trainer.routing_replay) with a real transformers Qwen3-MoE (4 experts,
top-2, a dense first layer): replaying the model's own routes changes nothing; replaying other routes makes every
router use them (with its own probabilities of them, so the router still learns); padding and micro-batching put
each sample's routes on its own tokens; a dense model or a disabled replay is refused or inert."""

from __future__ import annotations

import pytest
import torch
from trainer_setup import make_batch, save_tiny_model, settings_for

from raygym.engines.raygym_server.routing_capture import RoutingCapture
from raygym.errors import ConfigError
from raygym.trainer import TrainBatch
from raygym.trainer.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return save_tiny_model("moe", tmp_path_factory.mktemp("replay"))


def own_routes(model_dir: str, batch: TrainBatch) -> list[torch.Tensor]:
    """What an engine answers for each sample, computed by the HF model itself: the routers' choices on every
    forwarded token (all but the last), flattened [tokens - 1, layers * top_k] int16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    capture = RoutingCapture(model)
    out = []
    with torch.no_grad():
        for t in batch.tokens:
            model(t[None, :-1])
            out.append(capture.take(1, t.numel() - 1)[0].reshape(t.numel() - 1, -1).to(torch.int16))
    return out


def shifted(routes: list[torch.Tensor], experts: int = 4) -> list[torch.Tensor]:
    """Other routes: every expert id + 1 (mod the expert count), still distinct within a token."""
    return [((r.long() + 1) % experts).to(torch.int16) for r in routes]


def log_probs(backend: TorchBackend, batch: TrainBatch) -> list[torch.Tensor]:
    return backend.compute_log_probs(batch).log_probs


def test_replaying_the_models_own_routes_changes_nothing(moe_path):
    batch = make_batch(seed=2)
    backend = TorchBackend(settings_for(moe_path, use_rollout_routing_replay=True))
    backend.init()
    free = log_probs(backend, batch)
    replayed = log_probs(backend, TrainBatch(**{**vars(batch), "routed_experts": own_routes(moe_path, batch)}))
    for a, b in zip(free, replayed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    tally = backend.replay.tally.metrics()
    expected = sum(t.numel() - 1 for t in batch.tokens)
    assert tally["train/routing_replay_tokens"] == expected and tally["train/routing_replay_differ_token_frac"] == 0.0


def test_every_router_uses_the_replayed_routes_on_each_samples_own_tokens(moe_path):
    """Right-padded rows [b, width]: row i's token t takes route row t of sample i (t < its length - 1); the last
    token and the padding keep the router's own choice."""
    from transformers import AutoModelForCausalLM

    from raygym.trainer.routing_replay import HFRoutingReplay

    batch = make_batch(seed=3)
    routes = shifted(own_routes(moe_path, batch))
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    replay = HFRoutingReplay(model, enabled=True)
    seen: list[torch.Tensor] = []  # registered after the replay's hook: what the layer uses
    model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone()))
    lengths = batch.total_lengths()
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(batch.tokens):
        ids[i, : t.numel()], mask[i, : t.numel()] = t, 1
    replay.use(routes, lengths, width)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    used = seen[-1].reshape(len(lengths), width, 2)
    for i, (route, n) in enumerate(zip(routes, lengths, strict=True)):
        want = route.reshape(n - 1, 2, 2)[:, 1].long()  # layer 1 (layer 0 is dense)
        assert torch.equal(used[i, : n - 1].sort(-1).values, want.sort(-1).values), i
    assert replay.tally.metrics()["train/routing_replay_differ_decision_frac"] == 1.0  # every choice was shifted


def test_the_router_still_learns_under_replay(moe_path):
    batch = make_batch(seed=3).with_advantages("grpo")
    forced = TrainBatch(**{**vars(batch), "routed_experts": shifted(own_routes(moe_path, batch))})
    backend = TorchBackend(settings_for(moe_path, use_rollout_routing_replay=True, lr=1e-2))
    backend.init()
    free, replayed = log_probs(backend, batch), log_probs(backend, forced)
    assert max(float((a - b).abs().max()) for a, b in zip(free, replayed, strict=True)) > 1e-3
    router = backend.model.model.layers[1].mlp.gate
    before = router.weight.detach().clone()
    metrics = backend.train_step(forced.with_log_probs(backend.compute_log_probs(forced)), rollout_id=0)
    assert not torch.equal(router.weight.detach(), before)  # the gate weights are its own: gradients reach it
    assert metrics["train/routing_replay_tokens"] > 0 and metrics["train/routing_replay_differ_token_frac"] == 1.0


def test_each_sample_gets_its_own_routes_whatever_the_micro_batches(moe_path):
    """One micro-batch of right-padded samples, or one sample per micro-batch: the same log-probs (sample 2
    carries no routes, so its routers choose)."""
    batch = make_batch(seed=4)
    routes = shifted(own_routes(moe_path, batch))
    routes[2] = torch.empty(0, dtype=torch.int16)
    forced = TrainBatch(**{**vars(batch), "routed_experts": routes})
    packed = TorchBackend(settings_for(moe_path, use_rollout_routing_replay=True, max_tokens_per_gpu=10_000))
    alone = TorchBackend(settings_for(moe_path, use_rollout_routing_replay=True, use_dynamic_batch_size=False,
                                      micro_batch_size=1))
    packed.init()
    alone.init()
    for a, b in zip(log_probs(packed, forced), log_probs(alone, forced), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    free = log_probs(alone, batch)
    torch.testing.assert_close(log_probs(alone, forced)[2], free[2], rtol=0, atol=1e-6)


def test_replay_is_inert_when_off_and_refused_on_a_dense_model(moe_path, tiny_model_path):
    batch = make_batch(seed=5)
    off = TorchBackend(settings_for(moe_path))
    off.init()
    forced = TrainBatch(**{**vars(batch), "routed_experts": shifted(own_routes(moe_path, batch))})
    for a, b in zip(log_probs(off, batch), log_probs(off, forced), strict=True):
        assert torch.equal(a, b)
    dense = TorchBackend(settings_for(tiny_model_path, use_rollout_routing_replay=True))
    with pytest.raises(ConfigError, match="no MoE routers"):
        dense.init()
