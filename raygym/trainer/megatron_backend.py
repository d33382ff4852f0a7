"""Megatron-core trainer backend: Qwen3 / Qwen3-MoE as a Megatron ``GPTModel`` with TP/SP/EP.

The extra ``megatron`` provides megatron-core; it is imported lazily (``pip install raygym[megatron]``).

* Parallel state comes from the recipe (tensor / pipeline / context / expert parallel sizes,
  ``sequence_parallel``) on the torchrun environment contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``). Data parallel is what is left of the world.
* HF weights are read from the checkpoint's safetensors and sharded with
  :mod:`raygym.trainer.weight_mapping`, the one HF <-> trainer mapping; export goes back through it.
* Log-probs and losses use :mod:`raygym.algo` (no second copy of the maths) and the same dynamic
  batching as the torch backend (``pack_micro_batches`` under ``max_tokens_per_gpu``).
* Samples of a micro-batch are packed into one row. ``qkv_format="bshd"`` runs Megatron's own
  attention with a block-diagonal causal mask (works everywhere); ``"thd"`` uses Transformer Engine
  with ``PackedSeqParams`` (GPU, needs transformer-engine).
* On a GPU the model is wrapped in Megatron's DistributedDataParallel and trained with Megatron's
  optimizer. Without CUDA (tests only: Megatron hard-codes ``torch.cuda`` in places, see
  ``tests/megatron/conftest.py``) a plain AdamW from ``raygym.trainer.optim`` steps the weights.

Limits of this version: pipeline_model_parallel_size > 1 and context_parallel_size > 1 are refused
with a ConfigError (parallel state supports them; the micro-batch schedule does not yet).

>>> opts = MegatronOptions(tensor_model_parallel_size=2, sequence_parallel=True)
>>> opts.data_parallel_size(world_size=8)
4
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from raygym.algo import entropy_from_logits, kl_loss, pack_micro_batches, policy_loss, tis_weights
from raygym.algo.batching import fixed_micro_batches, optimizer_step_slices
from raygym.errors import ConfigError, RaygymError
from raygym.trainer.backend import TrainerBackend, TrainerSettings, call_hook, dist_env
from raygym.trainer.weight_mapping import (
    ModelShape,
    expert_offset,
    hf_to_megatron,
    layer_offset,
    megatron_to_hf,
    param_maps_by_name,
    to_global_name,
)

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


@dataclass
class MegatronOptions:
    """Megatron-only recipe fields (same names as the recipe) plus the parameter dtype.

    ``params_dtype``: "bfloat16" (default on GPU) or "float32" (exact comparisons, CPU tests).
    """

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    recompute_granularity: str | None = "full"
    recompute_method: str | None = "uniform"
    recompute_num_layers: int | None = 1
    qkv_format: str = "thd"
    attention_softmax_in_fp32: bool = True
    accumulate_allreduce_grads_in_fp32: bool = True
    use_distributed_optimizer: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    params_dtype: str = "bfloat16"

    @classmethod
    def from_recipe(cls, recipe: Any, **overrides: Any) -> MegatronOptions:
        """Read every field by name from ``recipe`` when present; ``overrides`` win."""
        values = {f.name: getattr(recipe, f.name) for f in fields(cls) if recipe is not None and hasattr(recipe, f.name)}
        values.update(overrides)
        return cls(**values)

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

    def validate(self, *, cuda: bool) -> None:
        """ConfigError for combinations this backend cannot run."""
        if self.qkv_format not in QKV_FORMATS:
            raise ConfigError(f"qkv_format={self.qkv_format!r}: use 'thd' (packed, Transformer Engine) or 'bshd'")
        if self.qkv_format == "thd" and not (cuda and has_transformer_engine()):
            raise ConfigError(
                "qkv_format='thd': packed THD attention needs a CUDA GPU with transformer-engine "
                "(pip install 'transformer-engine[pytorch]'); set qkv_format='bshd' to use Megatron's own attention"
            )
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
        if self.recompute_granularity not in (None, "none", "full", "selective"):
            raise ConfigError(
                f"recompute_granularity={self.recompute_granularity!r}: use 'full', 'selective' or None"
            )
        if self.recompute_granularity == "full" and self.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"recompute_method={self.recompute_method!r}: use 'uniform' or 'block'")

    def torch_dtype(self) -> torch.dtype:
        try:
            return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.params_dtype]
        except KeyError:
            raise ConfigError(f"params_dtype={self.params_dtype!r}: use 'bfloat16', 'float16' or 'float32'") from None


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
    granularity = None if opts.recompute_granularity in (None, "none") else opts.recompute_granularity
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
            moe_token_dispatcher_type="alltoall" if opts.expert_model_parallel_size > 1 else "allgather",
            moe_layer_freq=[1 if i in shape.moe_layers else 0 for i in range(shape.num_layers)],
            moe_grouped_gemm=False,
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


def init_parallel_state(opts: MegatronOptions, *, timeout_s: float = 600.0, seed: int = 1234) -> dict[str, int]:
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
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=opts.tensor_model_parallel_size,
            pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
            context_parallel_size=opts.context_parallel_size,
            expert_model_parallel_size=opts.expert_model_parallel_size,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
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


def _safetensors_index(checkpoint_dir: str) -> dict[str, str]:
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


def _unwrap(model: Any) -> Any:
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


def pack_samples(tokens: Sequence[torch.Tensor], multiple: int = 1, with_mask: bool = True) -> PackedMicroBatch:
    """Concatenate ``tokens`` into one row with per-sample positions and a block-diagonal causal mask."""
    lengths = [int(t.numel()) for t in tokens]
    total = sum(lengths)
    padded = -(-max(total, 1) // multiple) * multiple
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


class MegatronBackend(TrainerBackend):
    """One rank of a Megatron-core trainer (see the module docstring).

    >>> backend = MegatronBackend(TrainerSettings(hf_checkpoint="/models/qwen3"),
    ...                           MegatronOptions(tensor_model_parallel_size=2, qkv_format="bshd"))
    >>> # backend.init(); backend.compute_log_probs(batch); backend.train_step(batch, rollout_id=0)
    """

    def __init__(self, settings: TrainerSettings, options: MegatronOptions | None = None, role: str = "actor") -> None:
        self.settings = settings
        self.options = options or MegatronOptions.from_recipe(settings.recipe)
        self.role = role
        self.model: Any = None
        self.optimizer: Any = None
        self.shape: ModelShape | None = None
        self.hf_config: dict[str, Any] = {}
        self.facts: dict[str, int] = {}
        self.device = torch.device("cpu")  # set in init(), after this rank picked its GPU
        self.use_te = False
        self.optimizer_step = 0
        self._offloaded = False

    # ---- set-up -------------------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        """Join the world, build the sharded model, load the HF checkpoint, build the optimizer."""
        require_megatron()
        cuda = torch.cuda.is_available()
        self.options.validate(cuda=cuda)
        if self.role != "actor":
            raise ConfigError(f"trainer role={self.role!r}: the megatron backend trains the actor only; use the torch backend for a critic")
        self.use_te = self.options.qkv_format == "thd"
        self.facts = init_parallel_state(self.options, timeout_s=self.settings.dist_timeout_s, seed=self.settings.seed)
        self.rank, self.world_size = self.facts["rank"], self.facts["world_size"]
        if cuda:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.hf_config = read_hf_config(self.settings.hf_checkpoint)
        model, self.shape = build_gpt_model(self.hf_config, self.options, self.facts["tp_size"], self.use_te)
        model = model.to(self.device)
        self.load_hf_checkpoint(model, self.settings.hf_checkpoint)
        self.model = self._wrap_for_training(model) if cuda else model
        self.optimizer = self._build_optimizer()
        n_params = sum(p.numel() for p in model.parameters())
        return {**self.facts, "backend": "megatron", "local_params": n_params, "qkv_format": self.options.qkv_format}

    def _wrap_for_training(self, model: Any) -> Any:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.options.accumulate_allreduce_grads_in_fp32,
            use_distributed_optimizer=self.options.use_distributed_optimizer,
            overlap_grad_reduce=False,
        )
        wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        model.config.finalize_model_grads_func = finalize_model_grads
        return wrapped

    def _build_optimizer(self) -> Any:
        s = self.settings
        if torch.cuda.is_available():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            dtype = self.options.torch_dtype()
            config = OptimizerConfig(
                optimizer="adam" if s.optimizer in ("adam", "adamw") else s.optimizer,
                lr=s.lr,
                min_lr=s.min_lr,
                weight_decay=s.weight_decay,
                adam_beta1=s.adam_beta1,
                adam_beta2=s.adam_beta2,
                clip_grad=s.clip_grad,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                params_dtype=dtype,
                use_distributed_optimizer=self.options.use_distributed_optimizer,
            )
            return get_megatron_optimizer(config, [self.model])
        from raygym.trainer.optim import build_optimizer, split_frozen

        trainable, _ = split_frozen(list(self.model.named_parameters()), s.freeze_params_name_list)
        return build_optimizer(
            trainable,
            name=s.optimizer,
            lr=s.lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.adam_beta1,
            adam_beta2=s.adam_beta2,
        )

    # ---- weights ------------------------------------------------------------------------------
    def _offsets(self) -> tuple[int, int]:
        assert self.shape is not None
        from megatron.core import parallel_state as ps

        lo = layer_offset(self.shape.num_layers, ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
        eo = expert_offset(self.shape.num_experts, self.facts["ep_rank"], self.facts["ep_size"])
        return lo, eo

    def _local_params(self, model: Any) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
        """(local name, global name, param) for every trained tensor of this rank."""
        lo, eo = self._offsets()
        for name, param in _unwrap(model).named_parameters():
            yield name, to_global_name(name, lo, eo), param

    def load_hf_checkpoint(self, model: Any, checkpoint_dir: str) -> None:
        """Copy this rank's shard of every HF tensor into ``model`` (bit for bit, then cast to the model dtype)."""
        from safetensors import safe_open

        assert self.shape is not None
        maps = param_maps_by_name(self.shape)
        where = _safetensors_index(checkpoint_dir)
        handles: dict[str, Any] = {}
        tp_rank, tp_size = self.facts["tp_rank"], self.facts["tp_size"]
        try:
            for _local, global_name, param in self._local_params(model):
                pm = maps.get(global_name)
                if pm is None:
                    raise RaygymError(f"megatron parameter {global_name} has no HF mapping in weight_mapping.py")
                tensors = []
                for hf_name in pm.hf:
                    if hf_name not in where:
                        raise ConfigError(f"hf_checkpoint={checkpoint_dir!r}: tensor {hf_name} is missing")
                    f = where[hf_name]
                    handles.setdefault(f, safe_open(f, "pt"))
                    tensors.append(handles[f].get_tensor(hf_name))
                shard = hf_to_megatron(pm, tensors, self.shape, tp_rank=tp_rank, tp_size=tp_size,
                                       padded_vocab_size=self.shape.padded_vocab_size(tp_size))
                if tuple(shard.shape) != tuple(param.shape):
                    raise RaygymError(f"{global_name}: HF shard shape {tuple(shard.shape)} != model {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
        finally:
            handles.clear()

    def iter_hf_weights(self, dtype: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight; a collective: every rank of the trainer must iterate.

        TP shards are all-gathered over the TP group and experts over the EP group, so every rank gets
        full tensors: CPU copies (never views of the live parameters), in ``dtype`` or the model's dtype.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.shape is not None
        maps = param_maps_by_name(self.shape)
        tp_group = ps.get_tensor_model_parallel_group()
        tp_size = self.facts["tp_size"]
        ep_size = self.facts["ep_size"]
        for local_name, global_name, param in self._local_params(self.model):
            pm = maps[global_name]
            local = param.detach()
            if ep_size > 1 and pm.expert is not None:
                yield from self._gathered_experts(local_name, pm, local, dtype)
                continue
            shards = [local]
            if pm.tp_dim is not None and tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            for hf_name, tensor in megatron_to_hf(pm, shards, self.shape):
                yield hf_name, tensor.to("cpu", dtype or tensor.dtype, copy=True)  # never alias live params

    def _gathered_experts(self, local_name: str, pm: Any, local: torch.Tensor, dtype: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """One local expert parameter of every EP rank (global experts ``e + k * experts_per_rank``)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        assert self.shape is not None
        ep_size, tp_size = self.facts["ep_size"], self.facts["tp_size"]
        maps = param_maps_by_name(self.shape)
        per_rank = self.shape.num_experts // ep_size
        tp_shards = [local]
        if pm.tp_dim is not None and tp_size > 1:
            tp_shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(tp_shards, local.contiguous(), group=ps.get_expert_tensor_parallel_group())
        stacked = torch.stack(tp_shards)
        everyone = [torch.empty_like(stacked) for _ in range(ep_size)]
        dist.all_gather(everyone, stacked, group=ps.get_expert_model_parallel_group())
        lo, _ = self._offsets()
        for ep_rank, shards in enumerate(everyone):
            gname = to_global_name(local_name, lo, ep_rank * per_rank)
            for hf_name, tensor in megatron_to_hf(maps[gname], list(shards), self.shape):
                yield hf_name, tensor.to("cpu", dtype or tensor.dtype, copy=True)  # never alias live params

    def save_hf(self, out_dir: str) -> str:
        """Write an HF model directory (config, tokenizer files, one safetensors file); rank 0 writes."""
        from safetensors.torch import save_file

        state = {name: t.contiguous() for name, t in self.iter_hf_weights()}
        if self.rank != 0:
            return out_dir
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        src = Path(self.settings.hf_checkpoint)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
        return str(out)

    # ---- forward ------------------------------------------------------------------------------
    def _forward_log_probs(self, tokens: Sequence[torch.Tensor], response_lengths: Sequence[int],
                           want_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sample response-token log-probs (and entropies) of one packed micro-batch; differentiable."""
        from megatron.core import tensor_parallel

        assert self.shape is not None
        tp_size = self.facts["tp_size"]
        packed = pack_samples(tokens, multiple=tp_size if self.options.sequence_parallel else 1,
                              with_mask=not self.use_te)
        ids = packed.input_ids.to(self.device)
        kwargs: dict[str, Any] = {}
        if self.use_te:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = packed.cu_seqlens.to(self.device)
            longest = int((cu[1:] - cu[:-1]).max())
            kwargs["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
            )
            mask = None
        else:
            mask = packed.attention_mask.to(self.device)
        logits = self.model(ids, packed.position_ids.to(self.device), attention_mask=mask, **kwargs)  # [1, T, V/tp]
        logits = logits.float() / float(self.settings.rollout_temperature)
        entropy = self._vocab_parallel_entropy(logits[0]) if want_entropy else None
        logits = self._mask_vocab_padding(logits)
        targets = torch.roll(ids, shifts=-1, dims=1)  # target at t is the token at t+1
        token_lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), targets.transpose(0, 1))
        token_lp = token_lp.transpose(0, 1)[0]  # [T]
        out_lp, out_ent = [], []
        for start, n, r in zip(packed.starts, packed.lengths, response_lengths, strict=True):
            lo, hi = start + n - r - 1, start + n - 1  # logits at t predict token t+1
            out_lp.append(token_lp[lo:hi])
            if entropy is not None:
                out_ent.append(entropy[lo:hi])
        return out_lp, out_ent

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf on padded vocabulary columns (they exist only in Megatron's padded embedding)."""
        assert self.shape is not None
        local = logits.shape[-1]
        first = self.facts["tp_rank"] * local
        n_real = max(0, min(local, self.shape.vocab_size - first))
        if n_real == local:
            return logits
        col = torch.arange(local, device=logits.device)
        return logits.masked_fill(col >= n_real, float("-inf"))

    def _vocab_parallel_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy over the real vocabulary ([T, V/tp] -> [T]); gathers the vocab shards when TP > 1."""
        assert self.shape is not None
        if self.facts["tp_size"] > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return entropy_from_logits(logits[..., : self.shape.vocab_size])

    def _micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """The torch backend's batching: pack by ``max_tokens_per_gpu`` or fixed ``micro_batch_size``."""
        s = self.settings
        if s.use_dynamic_batch_size:
            return pack_micro_batches(lengths, s.max_tokens_per_gpu)
        return fixed_micro_batches(len(lengths), s.micro_batch_size)

    def _dp_share(self, indices: Sequence[int]) -> list[int]:
        from raygym.algo import contiguous_shard

        share = contiguous_shard(len(indices), self.facts["dp_rank"], self.facts["dp_size"])
        return [indices[i] for i in share]

    def compute_log_probs(self, batch: Any, rollout_id: int = -1) -> dict[str, list[torch.Tensor]]:
        """Policy log-probs of every response token of every sample (same result on every rank)."""
        batch = call_hook(self.settings, "custom_megatron_before_log_prob_hook", rollout_id, batch)
        mine = self._dp_share(list(range(len(batch))))
        results: dict[int, torch.Tensor] = {}
        self.model.eval()
        with torch.no_grad():
            lengths = [int(batch.tokens[i].numel()) for i in mine]
            for mb in self._micro_batches(lengths):
                idx = [mine[j] for j in mb]
                lps, _ = self._forward_log_probs([batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx])
                for i, lp in zip(idx, lps, strict=True):
                    results[i] = lp.float().cpu()
        self.model.train()
        return {"log_probs": self._gather_over_dp(results, len(batch))}

    def _gather_over_dp(self, mine: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.facts["dp_size"] == 1:
            return [mine[i] for i in range(n)]
        everyone: list[Any] = [None] * self.facts["dp_size"]
        dist.all_gather_object(everyone, mine, group=ps.get_data_parallel_group(with_context_parallel=True))
        merged: dict[int, torch.Tensor] = {}
        for part in everyone:
            merged.update(part)
        return [merged[i] for i in range(n)]

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batch: Any, rollout_id: int) -> dict[str, float]:
        """One rollout's optimizer steps; loss maths from raygym.algo, metrics averaged over steps and ranks."""
        s = self.settings
        batch = call_hook(s, "custom_megatron_before_train_step_hook", rollout_id, batch)
        if batch.advantages is None or batch.old_log_probs is None:
            raise RaygymError("train_step needs batch.advantages and batch.old_log_probs (compute_log_probs first)")
        totals: dict[str, float] = {}
        steps = optimizer_step_slices(len(batch), s.global_batch_size)
        for step_indices in steps:
            for k, v in self._one_optimizer_step(batch, step_indices).items():
                totals[k] = totals.get(k, 0.0) + v / len(steps)
        return totals

    def _one_optimizer_step(self, batch: Any, step_indices: list[int]) -> dict[str, float]:
        from raygym.trainer.optim import lr_at

        s = self.settings
        num_samples = len(step_indices)
        num_tokens = max(1.0, float(sum(float(batch.loss_masks[i].sum()) for i in step_indices)))
        mine = self._dp_share(step_indices)
        self._zero_grad()
        metrics: dict[str, torch.Tensor] = {}
        lengths = [int(batch.tokens[i].numel()) for i in mine]
        # Losses are pre-divided by global sample/token counts, so micro-batch gradients add up to the full
        # batch's gradient on every data-parallel rank; the DP all-reduce must then SUM, hence * dp_size below
        # cancels Megatron's averaging.
        dp_size = self.facts["dp_size"]
        for mb in self._micro_batches(lengths):
            idx = [mine[j] for j in mb]
            loss, mb_metrics = self._micro_batch_loss(batch, idx, num_samples, num_tokens)
            (loss * dp_size).backward()
            for k, v in mb_metrics.items():
                metrics[k] = metrics.get(k, torch.zeros(())) + v.detach().float().cpu()
        lr = lr_at(self.optimizer_step, lr=s.lr, min_lr=s.min_lr, warmup_iters=s.lr_warmup_iters,
                   decay_iters=s.lr_decay_iters or s.total_optimizer_steps(), style=s.lr_decay_style)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._step_optimizer()
        self.optimizer_step += 1
        out = {f"train/{k}": float(v) for k, v in self._sum_over_dp(metrics).items()}
        out["train/grad_norm"] = float(grad_norm)
        out["train/lr"] = lr
        return out

    def _micro_batch_loss(self, batch: Any, idx: list[int], num_samples: int, num_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch with raygym.algo, aggregated against the optimizer step's global counts."""
        from torch.nn.utils.rnn import pad_sequence

        s = self.settings
        want_entropy = s.entropy_coef != 0.0
        lps, ents = self._forward_log_probs([batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx], want_entropy)
        dev = lps[0].device

        def padded(values: Sequence[torch.Tensor]) -> torch.Tensor:
            return pad_sequence([v.to(dev, torch.float32) for v in values], batch_first=True)

        log_probs = padded(lps)
        mask = padded([batch.loss_masks[i] for i in idx])
        old = padded([batch.old_log_probs[i] for i in idx])
        adv = padded([batch.advantages[i] for i in idx])
        agg = {"per_token": s.calculate_per_token_loss, "num_samples": num_samples, "num_tokens": num_tokens}
        weights = None
        if s.use_tis and batch.rollout_log_probs is not None:
            weights = tis_weights(old, padded([batch.rollout_log_probs[i] for i in idx]), s.tis_clip)
        ratio_level = "sequence" if s.advantage_estimator == "gspo" else "token"
        loss, metrics = policy_loss(log_probs, old, adv, mask, eps_clip=s.eps_clip, eps_clip_high=s.eps_clip_high,
                                    eps_clip_c=s.eps_clip_c, tis_weights=weights, ratio_level=ratio_level, **agg)
        metrics = {**metrics, "pg_loss": loss.detach()}
        if s.use_kl_loss and s.kl_loss_coef != 0.0 and batch.ref_log_probs is not None:
            kl = kl_loss(log_probs, padded([batch.ref_log_probs[i] for i in idx]), mask, s.kl_loss_type, **agg)
            loss = loss + s.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        if want_entropy:
            from raygym.algo import aggregate

            entropy = aggregate(padded(ents), mask, **agg)
            loss = loss - s.entropy_coef * entropy
            metrics["entropy"] = entropy.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics

    def _zero_grad(self) -> None:
        if hasattr(self.model, "zero_grad_buffer"):
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _step_optimizer(self) -> float:
        if torch.cuda.is_available():
            from megatron.core.distributed import finalize_model_grads

            # DP all-reduce of the grad buffers plus the TP all-reduce of sequence-parallel norm grads.
            finalize_model_grads([self.model])
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RaygymError("megatron optimizer step was skipped (non-finite gradients)")
            return float(grad_norm or 0.0)
        return self._cpu_step()

    def _cpu_step(self) -> float:
        """Tests only (no CUDA): DP-sum grads, TP-aware global norm, clip, AdamW step."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.facts["dp_size"] > 1:
            for p in params:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                p.grad /= self.facts["dp_size"]
        tp_rank = self.facts["tp_rank"]
        # TP-sharded params contribute their shard; replicated ones are counted on TP rank 0 only.
        sq = sum(float(p.grad.float().square().sum()) for p in params
                 if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
        total = torch.tensor([sq], dtype=torch.float64)
        if self.facts["tp_size"] > 1:
            dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
        norm = float(total.sqrt())
        clip = self.settings.clip_grad
        if clip and clip > 0 and norm > clip:
            for p in params:
                p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        return norm

    def _sum_over_dp(self, metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.facts["dp_size"] == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        stacked = torch.stack([metrics[k] for k in keys]).to(self.device)
        dist.all_reduce(stacked, group=ps.get_data_parallel_group())
        return dict(zip(keys, stacked.cpu(), strict=True))

    # ---- memory and checkpoints ---------------------------------------------------------------
    def offload(self) -> None:
        """Move weights, grads and optimizer state to host memory (colocated rollout phase)."""
        if self._offloaded or self.device.type != "cuda":
            return
        if hasattr(self.model, "offload_grad_buffers"):
            self.model.offload_grad_buffers()
        for buf in getattr(self.model, "buffers", []) + getattr(self.model, "expert_parallel_buffers", []):
            buf.offload_to_cpu(move_params=True, move_grads=False)
        self._move_optimizer_state("cpu")
        torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        """Bring everything back to the GPU."""
        if not self._offloaded:
            return
        for buf in getattr(self.model, "buffers", []) + getattr(self.model, "expert_parallel_buffers", []):
            buf.reload_from_cpu(move_params=True, move_grads=False)
        if hasattr(self.model, "restore_grad_buffers"):
            self.model.restore_grad_buffers()
        self._move_optimizer_state(self.device)
        self._offloaded = False

    def _move_optimizer_state(self, device: Any) -> None:
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in optimizers:
            inner = getattr(opt, "optimizer", opt)
            for state in inner.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v):
                        state[k] = v.to(device, non_blocking=True)
            for group in getattr(opt, "shard_fp32_from_float16_groups", []) + getattr(opt, "fp32_from_float16_groups", []):
                for p in group:
                    p.data = p.data.to(device, non_blocking=True)

    def checkpoint_state(self, include_optimizer: bool) -> dict[str, Any] | None:
        """Full HF-named weights and the schedule position on rank 0 (None elsewhere).

        Optimizer state is Megatron-sharded; it is included only for a single-rank trainer.
        """
        weights = dict(self.iter_hf_weights())
        if self.rank != 0:
            return None
        state: dict[str, Any] = {"model": weights, "optimizer_step": self.optimizer_step}
        if include_optimizer and self.world_size == 1:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_checkpoint_state(self, state: dict[str, Any] | None, load_optimizer: bool) -> None:
        """Restore weights (every rank takes its shard of the full HF-named state) and the schedule position."""
        import torch.distributed as dist

        assert self.shape is not None
        holder = [state]
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(holder, src=0)
        state = holder[0]
        if state is None:
            return
        maps = param_maps_by_name(self.shape)
        tp_rank, tp_size = self.facts["tp_rank"], self.facts["tp_size"]
        for _local, global_name, param in self._local_params(self.model):
            pm = maps[global_name]
            shard = hf_to_megatron(pm, [state["model"][n] for n in pm.hf], self.shape, tp_rank=tp_rank, tp_size=tp_size)
            with torch.no_grad():
                param.copy_(shard.to(param.dtype))
        self.optimizer_step = int(state.get("optimizer_step", 0))
        if load_optimizer and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])

    def shutdown(self) -> None:
        """Tear down Megatron's groups and this rank's process group."""
        shutdown_parallel_state()
