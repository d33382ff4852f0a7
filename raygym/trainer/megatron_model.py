"""Building blocks of the Megatron backend: options, the Megatron ``GPTModel`` of a Qwen3 / Qwen3-MoE HF
checkpoint, the parallel state, packing samples into one row and the vocabulary-parallel entropy.

megatron-core is imported lazily (``pip install 'raygym[megatron]'``). The backend itself is
:mod:`raygym.trainer.megatron_backend`; its CPU mode is :mod:`raygym.trainer.megatron_cpu`.

>>> from raygym.config import Recipe
>>> opts = MegatronOptions.from_recipe(Recipe(tensor_model_parallel_size=2, sequence_parallel=True), "auto")
>>> opts.data_parallel_size(world_size=8), opts.resolved_qkv_format(cuda=False), opts.torch_dtype(cuda=False)
(4, 'bshd', torch.float32)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raygym.config.recipe import Recipe
from raygym.config.views import build_view, recipe_view
from raygym.errors import ConfigError
from raygym.trainer.backend import TrainerSettings, dist_env
from raygym.trainer.weight_mapping import ModelShape

MEGATRON_EXTRA_HINT = "pip install 'raygym[megatron]' (megatron-core >= 0.12; 0.16.x on Python 3.11)"
QKV_FORMATS = ("thd", "bshd")


def require_megatron() -> Any:
    """Import megatron.core or raise ImportError naming the extra to install."""
    try:
        import megatron.core as mcore
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"the megatron trainer backend needs megatron-core: {MEGATRON_EXTRA_HINT} ({exc})") from exc
    return mcore


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


@recipe_view(extras=("params_dtype",))
@dataclass(frozen=True)
class MegatronOptions:
    """The Megatron-only recipe fields (same names as the recipe) plus the parameter dtype.

    ``params_dtype`` (``model.dtype``): "auto" (bfloat16 on GPU, float32 in CPU mode), "bfloat16", "float16"
    or "float32". ``qkv_format``: "thd" (packed, Transformer Engine on GPU) or "bshd" (Megatron's own
    attention with a block-diagonal mask); see :meth:`resolved_qkv_format`.
    """

    tensor_model_parallel_size: int
    sequence_parallel: bool
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    recompute_granularity: str
    recompute_method: str
    recompute_num_layers: int
    qkv_format: str
    attention_softmax_in_fp32: bool
    accumulate_allreduce_grads_in_fp32: bool
    use_distributed_optimizer: bool
    attention_dropout: float
    hidden_dropout: float
    params_dtype: str

    @classmethod
    def from_recipe(cls, recipe: Recipe, params_dtype: str) -> MegatronOptions:
        """The Megatron view of ``recipe``; ``params_dtype`` is the model config's ``dtype``."""
        return build_view(cls, recipe, params_dtype=params_dtype)

    @classmethod
    def from_settings(cls, settings: TrainerSettings) -> MegatronOptions:
        """The Megatron view of the trainer's config (which carries the Megatron fields)."""
        return build_view(cls, settings, params_dtype=settings.dtype)

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks of ``world_size``; ConfigError when the world does not split evenly."""
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(
                f"tensor_model_parallel_size*pipeline_model_parallel_size*context_parallel_size={mp}: the trainer "
                f"world of {world_size} ranks is not a multiple of it; use actor_num_gpus_per_node*actor_num_nodes "
                "that is a multiple of the model-parallel size"
            )
        return world_size // mp

    def resolved_qkv_format(self, *, cuda: bool) -> str:
        """The attention layout that runs: ``qkv_format`` on a GPU; ``"bshd"`` in CPU mode, where the
        packed THD kernels (Transformer Engine, CUDA only) do not exist. Both see the same packed micro-batch
        and compute the same attention (THD by sequence boundaries, bshd by a block-diagonal causal mask)."""
        if self.qkv_format not in QKV_FORMATS:
            raise ConfigError(f"qkv_format={self.qkv_format!r}: use 'thd' (packed, Transformer Engine) or 'bshd'")
        return self.qkv_format if cuda else "bshd"

    def validate(self, *, cuda: bool) -> None:
        """ConfigError for combinations this backend cannot run."""
        if self.resolved_qkv_format(cuda=cuda) == "thd" and not has_transformer_engine():
            raise ConfigError(
                "qkv_format='thd': packed THD attention on a GPU needs transformer-engine "
                "(pip install 'transformer-engine[pytorch]'); set qkv_format='bshd' to use Megatron's own attention"
            )
        self.torch_dtype(cuda=cuda)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("sequence_parallel=True: needs tensor_model_parallel_size > 1; set sequence_parallel=False")
        if self.pipeline_model_parallel_size != 1:
            raise ConfigError(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}: the megatron backend does not "
                "run pipeline schedules yet; use tensor_model_parallel_size / expert_model_parallel_size instead"
            )
        if self.context_parallel_size != 1:
            raise ConfigError(
                f"context_parallel_size={self.context_parallel_size}: not supported by the megatron backend yet; "
                "set context_parallel_size=1"
            )

    def torch_dtype(self, *, cuda: bool | None = None) -> torch.dtype:
        """The parameter dtype; ``"auto"`` is bfloat16 on a GPU and float32 in CPU mode."""
        name = self.params_dtype
        if name == "auto":
            name = "bfloat16" if (torch.cuda.is_available() if cuda is None else cuda) else "float32"
        try:
            return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
        except KeyError:
            raise ConfigError(
                f"params_dtype={self.params_dtype!r}: use 'auto', 'bfloat16', 'float16' or 'float32'"
            ) from None


def read_hf_config(checkpoint_dir: str) -> dict[str, Any]:
    """The ``config.json`` of an HF checkpoint directory as a dict."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise ConfigError(f"hf_checkpoint={checkpoint_dir!r}: no config.json there; give a local HF model directory")
    return json.loads(path.read_text())


def rope_base(hf_config: dict[str, Any]) -> float:
    """RoPE base frequency; transformers 5 keeps it under ``rope_parameters``."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    return float(hf_config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def transformer_config(hf_config: dict[str, Any], opts: MegatronOptions, shape: ModelShape) -> Any:
    """A Megatron ``TransformerConfig`` equivalent to the HF Qwen3 / Qwen3-MoE config."""
    require_megatron()
    from megatron.core.transformer import TransformerConfig

    cuda = torch.cuda.is_available()
    dtype = opts.torch_dtype()
    granularity = opts.recompute_granularity
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(hf_config.get("attention_bias", False)),
        qk_layernorm=shape.qk_norm,
        hidden_dropout=opts.hidden_dropout,
        attention_dropout=opts.attention_dropout,
        attention_softmax_in_fp32=opts.attention_softmax_in_fp32,
        tensor_model_parallel_size=opts.tensor_model_parallel_size,
        pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
        context_parallel_size=opts.context_parallel_size,
        expert_model_parallel_size=opts.expert_model_parallel_size,
        sequence_parallel=opts.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        recompute_granularity=granularity,
        recompute_method=opts.recompute_method if granularity == "full" else None,
        recompute_num_layers=opts.recompute_num_layers if granularity == "full" else None,
        # Weights are overwritten from the checkpoint: skip the random init work.
        perform_initialization=False,
        use_cpu_initialization=not cuda,
        # Fused kernels exist on GPU only; the unfused paths compute the same functions.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if shape.num_experts:
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_intermediate_size,
            moe_router_topk=int(hf_config["num_experts_per_tok"]),
            # Qwen3-MoE: softmax over all experts then top-k, renormalised when norm_topk_prob; Megatron's
            # top-k-then-softmax is that renormalised form, pre-softmax is the plain one.
            moe_router_pre_softmax=not bool(hf_config.get("norm_topk_prob", True)),
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            # all-to-all needs CUDA streams; CPU mode all-gathers tokens over the expert group (same maths)
            moe_token_dispatcher_type="alltoall" if opts.expert_model_parallel_size > 1 and cuda else "allgather",
            moe_layer_freq=[1 if i in shape.moe_layers else 0 for i in range(shape.num_layers)],
            moe_grouped_gemm=False,
            expert_tensor_parallel_size=1,  # experts split over expert-parallel ranks only (init_parallel_state)
        )
    return TransformerConfig(**kwargs)


def layer_spec(shape: ModelShape, use_te: bool) -> Any:
    """Megatron's local (pure torch) or Transformer-Engine layer spec for Qwen3 blocks."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = shape.num_experts or None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=shape.qk_norm)
    return specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=shape.qk_norm, normalization="RMSNorm")


def decoder_block_spec(config: Any, shape: ModelShape, use_te: bool) -> Any:
    """Per-layer specs (dense and MoE layers mixed as ``moe_layer_freq`` says) or one spec for all."""
    if not shape.num_experts:
        return layer_spec(shape, use_te)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", qk_l2_norm=False)


def _fill_missing_te_router_gemm() -> None:
    """megatron-core 0.16 without transformer-engine: the MoE router reads ``moe_utils.te_general_gemm``,
    which is only bound when TE imports (NameError otherwise). ``None`` is the value its own code tests
    for to take the plain torch matmul path, so define it as ``None`` when TE is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(hf_config: dict[str, Any], opts: MegatronOptions, tp_size: int, use_te: bool) -> tuple[Any, ModelShape]:
    """An (unloaded) Megatron GPTModel for this rank and the model's :class:`ModelShape`."""
    require_megatron()
    from megatron.core.models.gpt import GPTModel

    shape = ModelShape.from_hf_config(hf_config, te_fused_norms=use_te)
    shape.check_tensor_parallel(tp_size)
    if shape.num_experts:
        _fill_missing_te_router_gemm()
    config = transformer_config(hf_config, opts, shape)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, shape, use_te),
        vocab_size=shape.padded_vocab_size(tp_size),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_base(hf_config)),
        parallel_output=True,
    )
    return model, shape


def init_parallel_state(opts: MegatronOptions, *, timeout_minutes: int, seed: int) -> dict[str, int]:
    """Join the torch.distributed world from the torchrun env and build Megatron's parallel groups."""
    require_megatron()
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    rank, world, local_rank = dist_env()
    cuda = torch.cuda.is_available()
    opts.data_parallel_size(world)
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=opts.tensor_model_parallel_size,
            pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
            context_parallel_size=opts.context_parallel_size,
            expert_model_parallel_size=opts.expert_model_parallel_size,
            # Whole experts per rank, as slime's Qwen3-MoE recipes (--expert-tensor-parallel-size 1); Megatron's
            # default (= tensor_model_parallel_size) would need TP x EP x PP GPUs, more than the recipe checks ask.
            expert_tensor_parallel_size=1,
            distributed_timeout_minutes=timeout_minutes,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return {
        "rank": rank,
        "world_size": world,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
    }


def shutdown_parallel_state() -> None:
    """Destroy Megatron's parallel groups and the default process group of this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def safetensors_index(checkpoint_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file in ``checkpoint_dir``."""
    from safetensors import safe_open

    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return {k: str(root / v) for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"hf_checkpoint={checkpoint_dir!r}: no *.safetensors files; save the model with safetensors")
    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            out.update({k: str(f) for k in handle.keys()})
    return out


def unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclass
class PackedMicroBatch:
    """Samples of one micro-batch packed into one row of ``T`` tokens (``T`` a multiple of the TP size).

    ``starts[i]`` is where sample i begins in the row; positions restart at 0 for every sample; the
    padding tail is its own segment so that every query attends to at least itself.
    """

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    attention_mask: torch.Tensor  # [1, 1, T, T] bool, True = masked out
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32, segment bounds (for THD)
    starts: list[int]
    lengths: list[int]


def pack_samples(tokens: Sequence[torch.Tensor], multiple: int = 1, with_mask: bool = True,
                 length: int | None = None) -> PackedMicroBatch:
    """Concatenate ``tokens`` into one row with per-sample positions and a block-diagonal causal mask; the row is
    padded to a multiple of ``multiple`` and to at least ``length`` tokens."""
    lengths = [int(t.numel()) for t in tokens]
    total = sum(lengths)
    padded = -(-max(total, length or 1, 1) // multiple) * multiple
    ids = torch.zeros(padded, dtype=torch.int64)
    pos = torch.zeros(padded, dtype=torch.int64)
    bounds = [0]
    for t, n in zip(tokens, lengths, strict=True):
        s = bounds[-1]
        ids[s : s + n] = t.to(torch.int64)
        pos[s : s + n] = torch.arange(n)
        bounds.append(s + n)
    if padded > total:
        pos[total:] = torch.arange(padded - total)
        bounds.append(padded)
    mask = torch.zeros(0)
    if with_mask:
        segment = torch.zeros(padded, dtype=torch.int64)
        for k in range(len(bounds) - 1):
            segment[bounds[k] : bounds[k + 1]] = k
        causal = torch.ones(padded, padded, dtype=torch.bool).tril()
        allowed = causal & (segment[:, None] == segment[None, :])
        mask = (~allowed)[None, None]
    return PackedMicroBatch(
        input_ids=ids[None],
        position_ids=pos[None],
        attention_mask=mask,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        starts=bounds[: len(tokens)],
        lengths=lengths,
    )


def vocab_parallel_entropy(logits: torch.Tensor, real_columns: int, tp_size: int) -> torch.Tensor:
    """Entropy of the softmax over the FULL vocabulary from this rank's ``[T, V/tp]`` slice of the logits,
    without gathering them: the max, the partition function and ``sum(p * logit)`` are reduced over the
    tensor-parallel group (differentiable: all-reduce forward, identity backward). Columns at or beyond
    ``real_columns`` (vocabulary padding) do not count. Equals ``entropy_from_logits`` of the full logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    valid = torch.arange(logits.shape[-1], device=logits.device) < real_columns
    peak = logits.detach().masked_fill(~valid, float("-inf")).amax(dim=-1)
    if tp_size > 1:
        import torch.distributed as dist

        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = (logits - peak[:, None]).masked_fill(~valid, 0.0)
    weights = torch.exp(shifted).masked_fill(~valid, 0.0)
    partition = weights.sum(dim=-1)
    weighted = (weights * shifted).sum(dim=-1)
    if tp_size > 1:
        partition = reduce_from_tensor_model_parallel_region(partition)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    return torch.log(partition) - weighted / partition
