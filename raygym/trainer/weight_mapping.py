"""The one conversion between HF parameter names/shapes and the trainers' own (pure torch, no Megatron).

Every path that moves weights out of a trainer (checkpoint export, every weight-sync transport) goes
through this module, so an engine always receives canonical HF names and shapes (the names of the
checkpoint on disk, e.g. one tensor per MoE expert).

* torch backend: the trainer trains the HF module itself, so the mapping is the identity up to the
  prefixes that wrappers add (``_orig_mod.`` from torch.compile, ``_fsdp_wrapped_module.``, ...):
  :func:`hf_name_from_torch`.
* Megatron backend (Qwen3 dense and MoE, local or Transformer-Engine layer specs): :func:`param_maps`
  lists every Megatron parameter with the HF tensors it is made of; :func:`hf_to_megatron` builds the
  local tensor-parallel shard of one Megatron parameter from its HF tensors, and
  :func:`megatron_to_hf` rebuilds the HF tensors from the shards of all TP ranks.

Megatron layouts handled here (shapes are [out_features, in_features]):

* ``linear_qkv``: Q, K and V fused and interleaved per query group (GQA): for each KV group g the
  rows are [the q heads of g, k_g, v_g], each head ``head_dim`` rows. TP splits whole groups, so a
  TP shard is a contiguous row block of the fused tensor.
* ``linear_fc1`` (SwiGLU): [gate; up] stacked on rows. TP shards gate and up separately, so shard r
  is [gate rows of r; up rows of r] — not a row block of the unsharded tensor.
* column-parallel tensors split rows (dim 0), row-parallel ones (``linear_proj``, ``linear_fc2``)
  split columns (dim 1); norms and the router are replicated.
* vocabulary tensors (embedding, output layer) are padded with zero rows to a multiple of the TP size.

Global names use global layer and expert numbers; a pipeline stage or expert-parallel rank holds a
slice of them under local numbers: :func:`to_global_name` / :func:`to_local_name` translate.

>>> shape = ModelShape(num_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
...                    head_dim=4, intermediate_size=16, vocab_size=10)
>>> [m.megatron for m in param_maps(shape)][:2]
['embedding.word_embeddings.weight', 'decoder.layers.0.input_layernorm.weight']
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from raygym.errors import ConfigError

Kind = Literal["copy", "qkv", "gate_up"]

# Prefixes that torch wrappers put in front of the HF module's own parameter names.
_TORCH_WRAPPER_PREFIXES = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module.")


def hf_name_from_torch(name: str) -> str:
    """The HF name of a torch-backend parameter: the identity, minus wrapper prefixes anywhere in it.

    >>> hf_name_from_torch("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
    'model.layers.0.mlp.up_proj.weight'
    """
    parts = name.split(".")
    wrappers = {p.rstrip(".") for p in _TORCH_WRAPPER_PREFIXES}
    return ".".join(p for p in parts if p not in wrappers)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs to know about a Qwen3 / Qwen3-MoE architecture.

    ``moe_layers`` lists the layers whose MLP is a mixture of experts (empty for dense models).
    ``te_fused_norms``: Transformer Engine layer specs store the pre-attention RMSNorm weight inside
    ``linear_qkv`` (``layer_norm_weight``) and, in dense layers, the pre-MLP one inside ``linear_fc1``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    te_fused_norms: bool = False

    @classmethod
    def from_hf_config(cls, config: Any, *, te_fused_norms: bool = False) -> ModelShape:
        """Read a ``transformers`` Qwen3/Qwen3-MoE config object or its ``config.json`` dict."""
        layers = int(_get(config, "num_hidden_layers"))
        heads = int(_get(config, "num_attention_heads"))
        hidden = int(_get(config, "hidden_size"))
        # Qwen3-MoE checkpoints say num_experts; transformers 5 writes num_local_experts.
        experts = int(_get(config, "num_experts", None) or _get(config, "num_local_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            step = int(_get(config, "decoder_sparse_step", 1) or 1)
            dense_only = set(_get(config, "mlp_only_layers", None) or [])
            moe_layers = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(_get(config, "num_key_value_heads", None) or heads),
            head_dim=int(_get(config, "head_dim", None) or hidden // heads),
            intermediate_size=int(_get(config, "intermediate_size")),
            vocab_size=int(_get(config, "vocab_size")),
            num_experts=experts,
            moe_intermediate_size=int(_get(config, "moe_intermediate_size", 0) or 0),
            moe_layers=moe_layers,
            tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
            te_fused_norms=te_fused_norms,
        )

    def padded_vocab_size(self, tp_size: int, multiple: int = 1) -> int:
        """Vocabulary rows in Megatron: ``vocab_size`` rounded up to a multiple of ``multiple * tp_size``."""
        step = multiple * tp_size
        return -(-self.vocab_size // step) * step

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ConfigError when ``tp_size`` cannot split this model's heads and MLPs evenly."""
        fix = "choose a tensor_model_parallel_size that divides it"
        checks = [
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
        ]
        if self.num_experts:
            checks.append(("moe_intermediate_size", self.moe_intermediate_size))
        for field, value in checks:
            if value % tp_size:
                raise ConfigError(
                    f"tensor_model_parallel_size={tp_size}: the model's {field}={value} is not divisible by it; {fix}"
                )


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter (global name) and the HF tensors it is made of.

    ``tp_dim``: the dimension split across tensor-parallel ranks (None = replicated).
    ``vocab``: rows are vocabulary entries (padded in Megatron).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"
    tp_dim: int | None = None
    vocab: bool = False
    layer: int | None = None
    expert: int | None = None


def _layer_maps(shape: ModelShape, i: int) -> list[ParamMap]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    attn_norm = "self_attention.linear_qkv.layer_norm_weight" if shape.te_fused_norms else "input_layernorm.weight"
    is_moe = i in shape.moe_layers
    mlp_norm = (
        "mlp.linear_fc1.layer_norm_weight" if shape.te_fused_norms and not is_moe else "pre_mlp_layernorm.weight"
    )
    maps = [
        ParamMap(f"{m}.{attn_norm}", (f"{h}.input_layernorm.weight",), layer=i),
        ParamMap(
            f"{m}.self_attention.linear_qkv.weight",
            (f"{h}.self_attn.q_proj.weight", f"{h}.self_attn.k_proj.weight", f"{h}.self_attn.v_proj.weight"),
            kind="qkv",
            tp_dim=0,
            layer=i,
        ),
        ParamMap(f"{m}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",), tp_dim=1, layer=i),
        ParamMap(f"{m}.{mlp_norm}", (f"{h}.post_attention_layernorm.weight",), layer=i),
    ]
    if shape.qk_norm:
        maps += [
            ParamMap(f"{m}.self_attention.q_layernorm.weight", (f"{h}.self_attn.q_norm.weight",), layer=i),
            ParamMap(f"{m}.self_attention.k_layernorm.weight", (f"{h}.self_attn.k_norm.weight",), layer=i),
        ]
    if not is_moe:
        maps += [
            ParamMap(
                f"{m}.mlp.linear_fc1.weight",
                (f"{h}.mlp.gate_proj.weight", f"{h}.mlp.up_proj.weight"),
                kind="gate_up",
                tp_dim=0,
                layer=i,
            ),
            ParamMap(f"{m}.mlp.linear_fc2.weight", (f"{h}.mlp.down_proj.weight",), tp_dim=1, layer=i),
        ]
        return maps
    maps.append(ParamMap(f"{m}.mlp.router.weight", (f"{h}.mlp.gate.weight",), layer=i))
    for e in range(shape.num_experts):
        me, he = f"{m}.mlp.experts.local_experts.{e}", f"{h}.mlp.experts.{e}"
        maps += [
            ParamMap(
                f"{me}.linear_fc1.weight",
                (f"{he}.gate_proj.weight", f"{he}.up_proj.weight"),
                kind="gate_up",
                tp_dim=0,
                layer=i,
                expert=e,
            ),
            ParamMap(f"{me}.linear_fc2.weight", (f"{he}.down_proj.weight",), tp_dim=1, layer=i, expert=e),
        ]
    return maps


def param_maps(shape: ModelShape) -> list[ParamMap]:
    """Every Megatron GPTModel parameter of ``shape`` (global names) with its HF source tensors."""
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_dim=0, vocab=True)]
    for i in range(shape.num_layers):
        maps += _layer_maps(shape, i)
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not shape.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), tp_dim=0, vocab=True))
    return maps


def param_maps_by_name(shape: ModelShape) -> dict[str, ParamMap]:
    """:func:`param_maps` keyed by global Megatron name."""
    return {m.megatron: m for m in param_maps(shape)}


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, d = shape.num_key_value_heads, shape.head_dim
    cols = q.shape[1:]
    # [groups, rows of one group, in]: the q heads of the group, then its k head, then its v head.
    fused = torch.cat(
        [q.reshape(groups, -1, *cols), k.reshape(groups, d, *cols), v.reshape(groups, d, *cols)], dim=1
    )
    return fused.reshape(-1, *cols)


def _split_qkv(fused: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.num_key_value_heads, shape.head_dim
    q_rows = shape.num_attention_heads // groups * d
    cols = fused.shape[1:]
    per_group = fused.reshape(groups, q_rows + 2 * d, *cols)
    q, k, v = torch.split(per_group, [q_rows, d, d], dim=1)
    return q.reshape(-1, *cols), k.reshape(-1, *cols), v.reshape(-1, *cols)


def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def hf_to_megatron(
    pm: ParamMap,
    hf: Sequence[torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    padded_vocab_size: int | None = None,
) -> torch.Tensor:
    """The tensor-parallel shard ``tp_rank`` of Megatron parameter ``pm`` from its HF tensors (in ``pm.hf`` order).

    The result is a fresh contiguous tensor with the HF dtype; values are copied bit for bit.
    """
    if len(hf) != len(pm.hf):
        raise ValueError(f"{pm.megatron}: expected {len(pm.hf)} HF tensors {pm.hf}, got {len(hf)}")
    if pm.kind == "qkv":
        full = _fuse_qkv(hf[0], hf[1], hf[2], shape)
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if pm.kind == "gate_up":
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf)
        return torch.cat([gate, up], dim=0).contiguous()
    t = hf[0]
    if pm.vocab:
        t = _pad_vocab(t, padded_vocab_size or shape.padded_vocab_size(tp_size))
    if pm.tp_dim is None or tp_size == 1:
        return t.clone().contiguous()
    if t.shape[pm.tp_dim] % tp_size:
        raise ConfigError(
            f"tensor_model_parallel_size={tp_size}: {pm.megatron} has {t.shape[pm.tp_dim]} entries on dim "
            f"{pm.tp_dim}, not divisible; choose a tensor_model_parallel_size that divides it"
        )
    return t.chunk(tp_size, dim=pm.tp_dim)[tp_rank].contiguous()


def megatron_to_hf(pm: ParamMap, shards: Sequence[torch.Tensor], shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of ``pm`` from the local shards of every TP rank (ordered by TP rank).

    For a replicated parameter pass one shard (or all; the first is used). Vocabulary padding is cut off.
    """
    if pm.tp_dim is None:
        return [(pm.hf[0], shards[0].contiguous())]
    if pm.kind == "qkv":
        q, k, v = _split_qkv(torch.cat(list(shards), dim=0), shape)
        return [(pm.hf[0], q.contiguous()), (pm.hf[1], k.contiguous()), (pm.hf[2], v.contiguous())]
    if pm.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return [(pm.hf[0], gate.contiguous()), (pm.hf[1], up.contiguous())]
    full = torch.cat(list(shards), dim=pm.tp_dim)
    if pm.vocab:
        full = full[: shape.vocab_size]
    return [(pm.hf[0], full.contiguous())]


@dataclass(frozen=True)
class HfBlock:
    """Where one block of a Megatron rank's parameter lies inside an HF tensor: ``sizes`` at ``offsets`` of
    a tensor of ``global_shape`` (what a sharded checkpoint stores; see ``raygym.checkpoint.tensor_shard``)."""

    hf_name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]


def hf_blocks(
    pm: ParamMap, local_shape: Sequence[int], shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1
) -> list[HfBlock]:
    """The HF blocks (one per HF tensor it holds a part of) of tensor-parallel shard ``tp_rank`` of ``pm``,
    whose local shape is ``local_shape``. A fused QKV shard holds whole query groups: one row block of each
    of q, k and v; a gate/up shard one row block of each; a vocabulary shard the rows it has before the
    padding (possibly none); a replicated tensor all of it.

    >>> shape = ModelShape(num_layers=1, hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
    ...                    head_dim=2, intermediate_size=6, vocab_size=9)
    >>> pm = param_maps_by_name(shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    >>> [(b.hf_name.split(".")[-2], b.offsets, b.sizes) for b in hf_blocks(pm, (8, 8), shape, tp_rank=1, tp_size=2)]
    [('q_proj', (4, 0), (4, 8)), ('k_proj', (2, 0), (2, 8)), ('v_proj', (2, 0), (2, 8))]
    """
    local = tuple(int(n) for n in local_shape)
    rest = local[1:]
    zeros = (0,) * len(local)
    if pm.tp_dim is None:
        return [HfBlock(pm.hf[0], zeros, local, local)]
    if pm.kind == "qkv":
        groups, d = shape.num_key_value_heads // tp_size, shape.head_dim
        q_rows = shape.num_attention_heads // shape.num_key_value_heads * d
        q = HfBlock(pm.hf[0], (tp_rank * groups * q_rows, *(0,) * len(rest)), (groups * q_rows, *rest),
                    (shape.num_attention_heads * d, *rest))
        kv = [HfBlock(name, (tp_rank * groups * d, *(0,) * len(rest)), (groups * d, *rest),
                      (shape.num_key_value_heads * d, *rest)) for name in pm.hf[1:]]
        return [q, *kv]
    if pm.kind == "gate_up":
        half = local[0] // 2
        return [HfBlock(name, (tp_rank * half, *(0,) * len(rest)), (half, *rest), (half * tp_size, *rest))
                for name in pm.hf]
    dim = pm.tp_dim
    offsets = list(zeros)
    offsets[dim] = tp_rank * local[dim]
    global_shape = list(local)
    global_shape[dim] = local[dim] * tp_size
    sizes = list(local)
    if pm.vocab:
        global_shape[0] = shape.vocab_size
        sizes[0] = max(0, min(local[0], shape.vocab_size - offsets[0]))
        if sizes[0] == 0:
            return []
    return [HfBlock(pm.hf[0], tuple(offsets), tuple(sizes), tuple(global_shape))]


def split_hf_blocks(
    pm: ParamMap, local: torch.Tensor, shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1
) -> list[torch.Tensor]:
    """The tensors of :func:`hf_blocks` (same order) cut from the local Megatron tensor ``local``."""
    blocks = hf_blocks(pm, local.shape, shape, tp_rank=tp_rank, tp_size=tp_size)
    if pm.tp_dim is None:
        return [local]
    rest = tuple(local.shape[1:])
    if pm.kind == "qkv":
        groups, d = shape.num_key_value_heads // tp_size, shape.head_dim
        q_rows = shape.num_attention_heads // shape.num_key_value_heads * d
        per_group = local.reshape(groups, q_rows + 2 * d, *rest)
        q, k, v = torch.split(per_group, [q_rows, d, d], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if pm.kind == "gate_up":
        return list(local.chunk(2, dim=0))
    return [local[: b.sizes[0]] if pm.vocab else local for b in blocks]


def join_hf_blocks(
    pm: ParamMap, blocks: Sequence[torch.Tensor], local_shape: Sequence[int], shape: ModelShape, *,
    tp_rank: int = 0, tp_size: int = 1,
) -> torch.Tensor:
    """Inverse of :func:`split_hf_blocks`: the local Megatron tensor (of ``local_shape``) from its HF blocks;
    vocabulary padding rows are zero."""
    local_shape = tuple(int(n) for n in local_shape)
    rest = local_shape[1:]
    if pm.kind == "qkv":
        groups = shape.num_key_value_heads // tp_size
        parts = [b.reshape(groups, -1, *rest) for b in blocks]
        return torch.cat(parts, dim=1).reshape(local_shape)
    if pm.kind == "gate_up":
        return torch.cat(list(blocks), dim=0)
    if pm.vocab:
        kept = blocks[0] if blocks else torch.zeros(0, *rest)
        pad = local_shape[0] - kept.shape[0]
        return torch.cat([kept, kept.new_zeros(pad, *rest)], dim=0) if pad else kept
    return blocks[0]


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


def _shift(name: str, layer_delta: int, expert_delta: int) -> str:
    name = _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_delta}.", name, count=1)
    return _EXPERT_RE.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_delta}.", name, count=1)


def to_global_name(local_name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Megatron name on one pipeline stage / expert-parallel rank -> global name.

    >>> to_global_name("decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight", 4, 8)
    'decoder.layers.5.mlp.experts.local_experts.8.linear_fc2.weight'
    """
    return _shift(local_name, layer_offset, expert_offset)


def to_local_name(global_name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Inverse of :func:`to_global_name`."""
    return _shift(global_name, -layer_offset, -expert_offset)


def layer_offset(num_layers: int, pp_rank: int, pp_size: int) -> int:
    """First global layer of pipeline stage ``pp_rank`` with an even split (what Megatron does by default)."""
    if num_layers % pp_size:
        raise ConfigError(
            f"pipeline_model_parallel_size={pp_size}: the model's num_hidden_layers={num_layers} is not "
            "divisible by it; choose a pipeline_model_parallel_size that divides it"
        )
    return pp_rank * (num_layers // pp_size)


def expert_offset(num_experts: int, ep_rank: int, ep_size: int) -> int:
    """First global expert held by expert-parallel rank ``ep_rank``."""
    if num_experts and num_experts % ep_size:
        raise ConfigError(
            f"expert_model_parallel_size={ep_size}: the model's num_experts={num_experts} is not divisible "
            "by it; choose an expert_model_parallel_size that divides it"
        )
    return ep_rank * (num_experts // ep_size) if num_experts else 0


def hf_state_to_megatron(
    hf_state: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Convenience for a whole model: HF state dict -> {global Megatron name: TP shard}."""
    return {
        pm.megatron: hf_to_megatron(pm, [hf_state[n] for n in pm.hf], shape, tp_rank=tp_rank, tp_size=tp_size)
        for pm in param_maps(shape)
    }


def megatron_states_to_hf(
    shards_by_rank: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape
) -> Iterable[tuple[str, torch.Tensor]]:
    """Convenience for a whole model: the global-name state of every TP rank -> (HF name, tensor) pairs."""
    for pm in param_maps(shape):
        yield from megatron_to_hf(pm, [s[pm.megatron] for s in shards_by_rank], shape)
