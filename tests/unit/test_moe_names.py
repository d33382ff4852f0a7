"""MoE expert tensors under the names each engine kind loads (raygym.weightsync.moe_names), checked against a real
transformers Qwen3-MoE: its fused in-memory tensors split into exactly the checkpoint's per-expert tensors (the
names SGLang and vLLM load), and per-expert tensors (what the Megatron backend yields) fuse back into the
in-memory ones (what raygym's server holds and checksums)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from raygym.builtin import TINY_MOE_MODEL, materialize_model
from raygym.weightsync.moe_names import EXPERT_LAYOUT, for_engine


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = materialize_model(TINY_MOE_MODEL, tmp_path_factory.mktemp("moe"), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    return model.state_dict(), load_file(f"{path}/model.safetensors")


def test_every_engine_kind_has_a_layout():
    from raygym.engine_api.kinds import ENGINE_KINDS

    assert set(EXPERT_LAYOUT) == set(ENGINE_KINDS)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_fused_in_memory_tensors_become_the_checkpoints_per_expert_tensors(moe, kind):
    in_memory, checkpoint = moe
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory  # what the torch backend yields
    sent = dict(for_engine(in_memory.items(), kind))
    assert sorted(sent) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(sent[name], tensor), name
        assert sent[name].is_contiguous()


def test_per_expert_tensors_fuse_into_the_in_memory_ones_for_raygyms_server(moe):
    in_memory, checkpoint = moe
    megatron_order = sorted(checkpoint.items(), key=lambda kv: (kv[0].split(".mlp.")[0], kv[0]))  # layer by layer
    sent = dict(for_engine(iter(megatron_order), "raygym"))
    assert sorted(sent) == sorted(in_memory)
    for name, tensor in in_memory.items():
        assert torch.equal(sent[name], tensor), name


def test_raygyms_server_gets_fused_tensors_unchanged(moe):
    in_memory, _ = moe
    sent = list(for_engine(in_memory.items(), "raygym"))
    assert [n for n, _ in sent] == list(in_memory) and all(a is b for (_, a), b in zip(sent, in_memory.values(), strict=True))


def test_experts_of_a_layer_split_by_another_module_are_refused():
    w = torch.zeros(2, 2)
    stream = [("model.layers.0.mlp.experts.0.gate_proj.weight", w), ("model.layers.0.mlp.experts.0.up_proj.weight", w),
              ("model.layers.0.mlp.gate.weight", w)]
    with pytest.raises(ValueError, match="incomplete experts"):
        list(for_engine(stream, "raygym"))
