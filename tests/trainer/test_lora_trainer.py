"""LoRA on the torch backend (peft) with the builtin tiny Qwen3: only the adapters learn, the KL reference is the
base model with the adapters off (no second copy), adapters alone leave the trainer (sync, checkpoints, export),
a checkpoint's adapter directory is one ``peft`` loads, and resume continues bit-identically."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from trainer_setup import free_port, join_local_world, make_batch, settings_for

from raygym.trainer import TrainBatch, TrainerActor
from raygym.trainer.torch_backend import TorchBackend

LORA = dict(lora_rank=4, lora_alpha=8, lr=1e-2)
ADAPTED = 7 * 2  # q, k, v, o, gate, up, down in each of the 2 layers


def prepared(backend: TorchBackend, batch: TrainBatch) -> TrainBatch:
    return batch.with_log_probs(backend.compute_log_probs(batch)).with_advantages("grpo")


def base_weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.model.named_parameters() if "lora_" not in n}


def test_only_the_adapters_learn_and_only_they_are_sent(tiny_model_path):
    backend = TorchBackend(settings_for(tiny_model_path, eps_clip=1.0, eps_clip_high=100.0, **LORA))
    info = backend.init()
    assert info["lora"] == {"rank": 4, "alpha": 8.0, "targets": ADAPTED} and not info["reference_model"]
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)]  # (in, out) of q k v o gate up down
    assert info["trainable_params"] == 2 * sum(4 * (i + o) for i, o in shapes)  # per layer: A r x in, B out x r
    sent = dict(backend.iter_hf_weights())
    assert len(sent) == 2 * ADAPTED and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in sent)
    assert sent["model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    assert all(torch.count_nonzero(t) == 0 for n, t in sent.items() if ".lora_B." in n)  # starts as the base
    before, adapters_before = base_weights(backend), {n: t.clone() for n, t in sent.items()}
    batch = prepared(backend, make_batch())
    losses = [backend.train_step(batch, rollout_id=i)["train/pg_loss"] for i in range(5)]
    assert losses[-1] < losses[0] - 0.02, losses
    after = base_weights(backend)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base never moves
    moved = dict(backend.iter_hf_weights())
    assert all(not torch.equal(moved[n], adapters_before[n]) for n in moved if ".lora_B." in n)


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model_path):
    from transformers import AutoModelForCausalLM

    backend = TorchBackend(settings_for(tiny_model_path, use_kl_loss=True, kl_loss_coef=0.1, **LORA))
    assert backend.init()["reference_model"] and backend.ref_model is None  # no second copy of the weights
    batch = make_batch(seed=2)
    first = backend.compute_log_probs(batch)
    for lp, ref in zip(first["log_probs"], first["ref_log_probs"], strict=True):
        assert torch.equal(lp, ref)  # B = 0: the adapted model is the base
    trained = prepared(backend, batch)
    for i in range(3):
        metrics = backend.train_step(trained, rollout_id=i)
    assert metrics["train/kl_loss"] > 0
    later = backend.compute_log_probs(batch)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(input_ids=batch.tokens[0][None]).logits[0].float()
    p = batch.prompt_lengths[0]
    resp = batch.tokens[0][p:]
    expected = torch.log_softmax(logits[p - 1 : p - 1 + len(resp)], dim=-1).gather(-1, resp[:, None]).squeeze(-1)
    torch.testing.assert_close(later["ref_log_probs"][0], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(later["log_probs"][0], later["ref_log_probs"][0], atol=1e-4)  # the policy moved


def test_checkpoint_holds_a_peft_adapter_and_resume_is_bit_identical(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raygym.checkpoint.store import checkpoint_adapter, export_adapter, export_merged

    batch = make_batch(seed=4)
    first = TrainerActor(settings=settings_for(tiny_model_path, **LORA))
    first.init()
    fixed = prepared(first.backend, batch)
    first.train_step(fixed, 0)
    path = first.save_checkpoint(0, extra={"data_index": 8}, save_dir=str(tmp_path / "ckpt"))
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(manifest["files"])
    assert checkpoint_adapter(path) == os.path.join(path, "adapter")
    losses_a = [first.train_step(fixed, i)["train/pg_loss"] for i in (1, 2)]

    second = TrainerActor(settings=settings_for(tiny_model_path, **LORA))
    second.init()
    loaded = second.load_checkpoint(str(tmp_path / "ckpt"))
    assert loaded["start_rollout_id"] == 1 and loaded["extra"] == {"data_index": 8}
    losses_b = [second.train_step(fixed, i)["train/pg_loss"] for i in (1, 2)]
    assert losses_a == losses_b  # adapters and their Adam state restored exactly
    a, b = dict(first.backend.iter_hf_weights()), dict(second.backend.iter_hf_weights())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    # The checkpoint's adapter (step 0) is one peft loads onto the base; merged, it is the same model.
    ids = batch.tokens[0][None]
    replay = TrainerActor(settings=settings_for(tiny_model_path, **LORA))
    replay.init()
    replay.load_checkpoint(str(tmp_path / "ckpt"))
    with torch.no_grad():
        expected = replay.backend.model(input_ids=ids).logits
    adapter_dir = export_adapter(path, str(tmp_path / "adapter"))
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors",
                                               "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, expected, rtol=0, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(export_merged(path, str(tmp_path / "merged")), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=ids).logits)


def test_end_of_run_export_is_the_adapter(tiny_model_path, tmp_path):
    from peft import PeftConfig

    actor = TrainerActor(settings=settings_for(tiny_model_path, **LORA))
    actor.init()
    out = actor.export_hf(str(tmp_path / "hf"))
    config = PeftConfig.from_pretrained(out)
    assert (config.r, config.lora_alpha, config.base_model_name_or_path) == (4, 8, actor.backend.model_path)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not os.path.exists(os.path.join(out, "config.json"))  # an adapter, not a model directory


def _fsdp_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    join_local_world(rank, world, port)
    backend = TorchBackend(settings_for(path, max_tokens_per_gpu=30, **LORA))
    backend.init()
    metrics = backend.train_step(prepared(backend, make_batch(seed=3)), rollout_id=0)
    weights = dict(backend.iter_hf_weights())
    if rank == 0:
        torch.save({"weights": weights, "metrics": metrics}, out)
    else:
        assert all(t is None for t in weights.values())
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # a separate process per rank
def test_two_fsdp_ranks_train_the_adapters_as_one_rank(tiny_model_path, tmp_path):
    out = str(tmp_path / "fsdp.pt")
    mp.start_processes(_fsdp_worker, args=(2, free_port(), tiny_model_path, out), nprocs=2, start_method="spawn")
    two = torch.load(out, weights_only=True)
    single = TorchBackend(settings_for(tiny_model_path, max_tokens_per_gpu=30, **LORA))
    single.init()
    metrics = single.train_step(prepared(single, make_batch(seed=3)), rollout_id=0)
    weights = dict(single.iter_hf_weights())
    assert weights.keys() == two["weights"].keys()
    for name, value in weights.items():
        assert (value - two["weights"][name]).norm() <= 1e-5 * max(value.norm(), 1e-3), name
    assert two["metrics"]["train/pg_loss"] == pytest.approx(metrics["train/pg_loss"], rel=1e-5, abs=1e-7)
