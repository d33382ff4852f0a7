"""Pure tests of raygym.trainer.weight_mapping: no megatron-core needed."""

from __future__ import annotations

import pytest
import torch

from raygym.errors import ConfigError
from raygym.trainer.weight_mapping import (
    ModelShape,
    expert_offset,
    hf_name_from_torch,
    hf_state_to_megatron,
    hf_to_megatron,
    layer_offset,
    megatron_states_to_hf,
    param_maps,
    param_maps_by_name,
    to_global_name,
    to_local_name,
)

DENSE = dict(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, vocab_size=45, tie_word_embeddings=False,
)
MOE = dict(DENSE, num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[0])


def _hf_dense_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**DENSE))


def _random_hf_state(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors with the shapes HF checkpoints use, derived from first principles."""
    g = torch.Generator().manual_seed(seed)
    h, d = shape.hidden_size, shape.head_dim
    sizes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (shape.vocab_size, h),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        sizes.update({
            f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (shape.num_attention_heads * d, h),
            f"{p}.self_attn.k_proj.weight": (shape.num_key_value_heads * d, h),
            f"{p}.self_attn.v_proj.weight": (shape.num_key_value_heads * d, h),
            f"{p}.self_attn.o_proj.weight": (h, shape.num_attention_heads * d),
            f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
        })
        if i in shape.moe_layers:
            sizes[f"{p}.mlp.gate.weight"] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                i2 = shape.moe_intermediate_size
                sizes.update({
                    f"{p}.mlp.experts.{e}.gate_proj.weight": (i2, h), f"{p}.mlp.experts.{e}.up_proj.weight": (i2, h),
                    f"{p}.mlp.experts.{e}.down_proj.weight": (h, i2),
                })
        else:
            sizes.update({
                f"{p}.mlp.gate_proj.weight": (shape.intermediate_size, h),
                f"{p}.mlp.up_proj.weight": (shape.intermediate_size, h),
                f"{p}.mlp.down_proj.weight": (h, shape.intermediate_size),
            })
    return {n: torch.randn(s, generator=g) for n, s in sizes.items()}


def test_shape_from_hf_config_reads_qwen3_and_moe_fields():
    from transformers import Qwen3MoeConfig

    shape = ModelShape.from_hf_config(Qwen3MoeConfig(**MOE))
    assert (shape.num_layers, shape.num_key_value_heads, shape.head_dim) == (2, 2, 8)
    assert shape.num_experts == 4 and shape.moe_intermediate_size == 16
    assert shape.moe_layers == (1,)  # layer 0 is listed in mlp_only_layers
    assert ModelShape.from_hf_config(DENSE).moe_layers == ()
    # transformers 5 serialises num_experts as num_local_experts
    renamed = {k: v for k, v in Qwen3MoeConfig(**MOE).to_dict().items() if k != "num_experts"}
    assert ModelShape.from_hf_config(renamed) == shape


def test_param_maps_cover_every_hf_tensor_of_a_real_qwen3_exactly_once():
    model = _hf_dense_model()
    shape = ModelShape.from_hf_config(model.config)
    hf_names = [n for pm in param_maps(shape) for n in pm.hf]
    assert sorted(hf_names) == sorted(model.state_dict().keys())
    assert len(set(hf_names)) == len(hf_names)


def test_tied_embeddings_have_no_output_layer():
    shape = ModelShape.from_hf_config(dict(DENSE, tie_word_embeddings=True))
    names = {pm.megatron for pm in param_maps(shape)}
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names


def test_te_spec_names_fuse_the_norms_into_the_next_linear():
    shape = ModelShape.from_hf_config(MOE, te_fused_norms=True)
    by = param_maps_by_name(shape)
    assert by["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].hf == ("model.layers.0.input_layernorm.weight",)
    assert by["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].hf == ("model.layers.0.post_attention_layernorm.weight",)
    # MoE layers keep a separate pre-MLP norm (the router reads the normalised input).
    assert by["decoder.layers.1.pre_mlp_layernorm.weight"].hf == ("model.layers.1.post_attention_layernorm.weight",)


def test_fused_qkv_rows_are_grouped_per_kv_head():
    shape = ModelShape.from_hf_config(DENSE)
    pm = param_maps_by_name(shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, h = shape.head_dim, shape.hidden_size
    # Each row holds its own id so the layout can be read back: q head j row r -> 1000*j + r, k: 10_000 + ..., v: 20_000 + ...
    q = (torch.arange(4 * d).float() + 1000 * (torch.arange(4 * d) // d)).unsqueeze(1).expand(-1, h)
    k = (10_000 + torch.arange(2 * d).float()).unsqueeze(1).expand(-1, h)
    v = (20_000 + torch.arange(2 * d).float()).unsqueeze(1).expand(-1, h)
    fused = hf_to_megatron(pm, [q, k, v], shape)
    heads_per_group = 2
    expected = []
    for gi in range(2):
        expected += [q[(gi * heads_per_group + j) * d:(gi * heads_per_group + j + 1) * d] for j in range(heads_per_group)]
        expected += [k[gi * d:(gi + 1) * d], v[gi * d:(gi + 1) * d]]
    assert torch.equal(fused, torch.cat(expected))
    # TP=2: rank r holds KV group r whole.
    assert torch.equal(hf_to_megatron(pm, [q, k, v], shape, tp_rank=1, tp_size=2), fused[fused.shape[0] // 2:])


def test_gate_up_tp_shard_interleaves_gate_and_up():
    shape = ModelShape.from_hf_config(DENSE)
    pm = param_maps_by_name(shape)["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    shard1 = hf_to_megatron(pm, [gate, up], shape, tp_rank=1, tp_size=2)
    assert torch.equal(shard1, torch.cat([gate[24:], up[24:]]))
    assert torch.equal(hf_to_megatron(pm, [gate, up], shape), torch.cat([gate, up]))


@pytest.mark.parametrize("arch", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_exact(arch, tp):
    shape = ModelShape.from_hf_config(arch)
    hf = _random_hf_state(shape, seed=tp)
    hf["model.layers.0.input_layernorm.weight"][0] = -0.0  # bytes, not values, must survive
    hf["model.layers.0.input_layernorm.weight"][1] = float("nan")
    shards = [hf_state_to_megatron(hf, shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    emb = shards[0]["embedding.word_embeddings.weight"]
    assert emb.shape[0] == shape.padded_vocab_size(tp) // tp
    back = dict(megatron_states_to_hf(shards, shape))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name].view(torch.int32), t.view(torch.int32)), name


def test_vocab_padding_rows_are_zero_and_cut_on_export():
    shape = ModelShape.from_hf_config(DENSE)  # vocab 45, odd
    assert shape.padded_vocab_size(2) == 46 and shape.padded_vocab_size(2, multiple=8) == 48
    pm = param_maps_by_name(shape)["output_layer.weight"]
    w = torch.randn(45, 32)
    last = hf_to_megatron(pm, [w], shape, tp_rank=1, tp_size=2)
    assert last.shape == (23, 32) and torch.count_nonzero(last[-1]) == 0


def test_tp_that_does_not_divide_kv_heads_is_a_config_error():
    shape = ModelShape.from_hf_config(DENSE)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4.*num_key_value_heads=2"):
        shape.check_tensor_parallel(4)
    shape.check_tensor_parallel(2)


def test_local_and_global_names_for_pipeline_and_expert_parallel():
    assert layer_offset(8, 1, 2) == 4 and expert_offset(8, 3, 4) == 6 and expert_offset(0, 1, 2) == 0
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    g = to_global_name(name, layer_offset=4, expert_offset=6)
    assert g == "decoder.layers.5.mlp.experts.local_experts.7.linear_fc1.weight"
    assert to_local_name(g, 4, 6) == name
    assert to_global_name("output_layer.weight", 4, 6) == "output_layer.weight"
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=3"):
        layer_offset(8, 0, 3)


def test_torch_backend_mapping_is_the_identity_minus_wrappers():
    model = _hf_dense_model()
    for name in model.state_dict():
        assert hf_name_from_torch(name) == name
        assert hf_name_from_torch("_orig_mod." + name.replace("layers.0.", "layers.0._checkpoint_wrapped_module.")) == name


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_blocks_cover_every_hf_tensor_once_and_join_back(kind, tp):
    """Checkpoint blocks: each TP shard cut into blocks of the HF tensors (split) equals the HF tensor at the
    block's offsets; the blocks of all TP ranks tile every HF tensor exactly once (vocabulary padding left
    out); joining the blocks rebuilds the shard (padding rows zero)."""
    from raygym.trainer.weight_mapping import hf_blocks, join_hf_blocks, split_hf_blocks

    shape = ModelShape.from_hf_config(DENSE if kind == "dense" else MOE)
    hf = _random_hf_state(shape, seed=3)
    covered = {name: torch.zeros(t.shape, dtype=torch.int64) for name, t in hf.items()}
    for pm in param_maps(shape):
        for rank in range(tp):
            local = hf_to_megatron(pm, [hf[n] for n in pm.hf], shape, tp_rank=rank, tp_size=tp)
            blocks = hf_blocks(pm, local.shape, shape, tp_rank=rank, tp_size=tp)
            pieces = split_hf_blocks(pm, local, shape, tp_rank=rank, tp_size=tp)
            assert len(blocks) == len(pieces) >= 1, pm.megatron
            for block, piece in zip(blocks, pieces, strict=True):
                assert block.global_shape == tuple(hf[block.hf_name].shape) == tuple(covered[block.hf_name].shape)
                region = tuple(slice(o, o + n) for o, n in zip(block.offsets, block.sizes, strict=True))
                assert torch.equal(hf[block.hf_name][region], piece), (pm.megatron, rank)
                if pm.tp_dim is not None or rank == 0:  # replicated tensors: every rank holds the same block
                    covered[block.hf_name][region] += 1
            assert torch.equal(join_hf_blocks(pm, pieces, local.shape, shape, tp_rank=rank, tp_size=tp), local)
    assert all(bool((c == 1).all()) for c in covered.values()), [n for n, c in covered.items() if not (c == 1).all()]
