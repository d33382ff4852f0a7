"""Megatron-core trainer backend: Qwen3 / Qwen3-MoE as a Megatron ``GPTModel`` with TP/SP/EP.

The extra ``megatron`` provides megatron-core; it is imported lazily (``pip install raygym[megatron]``).

* Parallel state comes from the recipe (tensor / expert parallel sizes, ``sequence_parallel``) on the
  torchrun environment contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``). Data parallel is what is left of the world. Pipeline and context parallel sizes > 1
  are refused by recipe validation (the micro-batch schedule does not run them).
* HF weights are read from the checkpoint's safetensors and sharded with
  :mod:`raygym.trainer.weight_mapping`, the one HF <-> trainer mapping; export goes back through it.
* The loss is :func:`raygym.algo.rl_loss`, the one the torch backend calls, with the same metrics; the
  batching is the torch backend's (``pack_micro_batches`` under ``max_tokens_per_gpu``).
* Reference model (``use_kl_loss`` / ``kl_coef``): a second, frozen ``GPTModel`` with the same parallel
  layout, loaded from ``ref_load`` or the initial weights; on a GPU it waits in host memory between uses.
* Checkpoints: each rank's blocks of the HF tensors (``raygym.trainer.megatron_state``), written by
  ``raygym.checkpoint.sharded`` with ``torch.distributed.checkpoint``; they load at any TP/EP/DP layout.
* Samples of a micro-batch are packed into one row. ``qkv_format="bshd"`` runs Megatron's own attention
  with a block-diagonal causal mask (works everywhere); ``"thd"`` uses Transformer Engine with
  ``PackedSeqParams`` (GPU, needs transformer-engine).
* On a GPU the model is wrapped in Megatron's DistributedDataParallel and trained with Megatron's
  optimizer. Without CUDA the backend runs in its CPU mode (:mod:`raygym.trainer.megatron_cpu`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from raygym.algo import pack_micro_batches
from raygym.algo.batching import contiguous_shard, fixed_micro_batches, optimizer_step_slices
from raygym.algo.rl_loss import rl_loss
from raygym.checkpoint.state import CheckpointState
from raygym.errors import ConfigError, RaygymError
from raygym.trainer.backend import (
    TrainerBackend,
    TrainerSettings,
    call_hook,
    check_declared_architecture,
    check_policy_batch,
    reference_model_path,
)
from raygym.trainer.contract import LogProbResult, advantage_stats, step_metrics_summary
from raygym.trainer.megatron_lockstep import lockstep_plan
from raygym.trainer.megatron_model import (
    MegatronOptions,
    build_gpt_model,
    has_transformer_engine,
    init_parallel_state,
    pack_samples,
    read_hf_config,
    require_megatron,
    shutdown_parallel_state,
    unwrap,
    vocab_parallel_entropy,
)
from raygym.trainer.megatron_state import (
    LocalParam,
    load_megatron_checkpoint_state,
    megatron_checkpoint_state,
)
from raygym.trainer.megatron_weights import MegatronWeights
from raygym.trainer.optim import LrSchedule
from raygym.trainer.routing_replay import MegatronRoutingReplay
from raygym.trainer.weight_mapping import (
    ModelShape,
)

PADDING_SAMPLE = torch.zeros(2, dtype=torch.int64)  # what a rank without a micro-batch forwards (lock step)

__all__ = ["MegatronBackend", "MegatronOptions", "has_transformer_engine", "require_megatron",
           "shutdown_parallel_state"]


class MegatronBackend(MegatronWeights, TrainerBackend):
    """One rank of a Megatron-core trainer (see the module docstring).

    >>> # cfg = TrainConfig(recipe=Recipe(tensor_model_parallel_size=2, qkv_format="bshd", ...), model=...)
    >>> # backend = MegatronBackend(TrainerSettings.from_config(cfg)); backend.init()
    >>> # backend.compute_log_probs(batch); backend.train_step(batch, rollout_id=0)
    """

    def __init__(self, settings: TrainerSettings, role: str = "actor") -> None:
        self.settings = settings
        self.options = MegatronOptions.from_settings(settings)
        self.role = role
        self.model: Any = None
        self.ref_model: Any = None
        self.optimizer: Any = None
        self.schedule: LrSchedule  # built by init()
        self.shape: ModelShape | None = None
        self.hf_config: dict[str, Any] = {}
        self.facts: dict[str, int] = {}
        self.device = torch.device("cpu")  # set in init(), after this rank picked its GPU
        self.use_te = False
        self.loss_config = settings.loss
        self.single_pass = False
        self.frozen: list[str] = []
        self._offloaded = False

    # ---- set-up -------------------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        """Join the world, build the sharded model, load the HF checkpoint, build the optimizer."""
        require_megatron()
        from raygym.builtin import resolve_model_path
        from raygym.trainer.decisions import reuses_current_log_probs

        cuda = torch.cuda.is_available()
        if self.role != "actor":
            raise ConfigError(f"trainer role={self.role!r}: the megatron backend trains the actor only; use the torch backend for a critic")
        self.options.validate(cuda=cuda)
        if not cuda:
            from raygym.trainer.megatron_cpu import enable_cpu_mode

            enable_cpu_mode()
        self.use_te = self.options.resolved_qkv_format(cuda=cuda) == "thd"
        self.facts = init_parallel_state(self.options, timeout_minutes=self.settings.distributed_timeout_minutes,
                                         seed=self.settings.seed)
        self.rank, self.world_size = self.facts["rank"], self.facts["world_size"]
        if cuda:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._set_cpu_threads()
        self.model_path = resolve_model_path(self.settings.hf_checkpoint)
        self.hf_config = read_hf_config(self.model_path)
        check_declared_architecture(self.settings, self.hf_config)
        model, self.shape = build_gpt_model(self.hf_config, self.options, self.facts["tp_size"], self.use_te)
        model = model.to(self.device)
        self.load_hf_checkpoint(model, self.model_path)
        self.replay = MegatronRoutingReplay(model, self.settings.use_rollout_routing_replay, self.shape.num_layers,
                                            int(self.hf_config.get("num_experts_per_tok", 0)))  # MoE: R3
        self.frozen = self._freeze(model)
        self.model = self._wrap_for_training(model) if cuda else model
        self.optimizer = self._build_optimizer()
        s = self.settings
        self.schedule = LrSchedule(
            self.optimizer, lr=s.lr, min_lr=s.min_lr, warmup_iters=s.lr_warmup_iters,
            decay_iters=s.lr_decay_iters if s.lr_decay_iters is not None else s.total_optimizer_steps(),
            style=s.lr_decay_style,
        )
        if s.uses_reference:
            self.ref_model = self._build_reference(reference_model_path(s, self.model_path))
        dropout = self.options.attention_dropout > 0 or self.options.hidden_dropout > 0
        self.single_pass = reuses_current_log_probs(s) and not dropout
        n_params = sum(p.numel() for p in model.parameters())
        return {
            **self.facts,
            "backend": "megatron",
            "role": self.role,
            "device": str(self.device),
            "cpu_mode": not cuda,
            "local_params": n_params,
            "qkv_format": "thd" if self.use_te else "bshd",
            "params_dtype": str(self.options.torch_dtype(cuda=cuda)).removeprefix("torch."),
            "reference_model": self.ref_model is not None,
            "frozen": self.frozen,
            "single_pass_log_probs": self.single_pass,
        }

    def _set_cpu_threads(self) -> None:
        from raygym.trainer.decisions import set_cpu_training_cores

        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        set_cpu_training_cores(self.settings, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))

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

    def _freeze(self, model: Any) -> list[str]:
        """``freeze_params_name_list``: a parameter is frozen when a pattern matches one of its HF names (as on
        the torch backend) or its Megatron name (a fused tensor freezes whole); returns the HF names frozen."""
        from raygym.trainer.optim import split_frozen

        mapped = self._mapped_params(model)
        split_frozen([(name, lp.param) for lp in mapped for name in (*lp.pm.hf, lp.pm.megatron)],
                     self.settings.freeze_params_name_list)
        return sorted(n for lp in mapped if not lp.param.requires_grad for n in lp.pm.hf)

    def _build_optimizer(self) -> Any:
        from raygym.trainer.optim import build_optimizer

        s = self.settings
        trainable = [(n, p) for n, p in unwrap(self.model).named_parameters() if p.requires_grad]
        if torch.cuda.is_available():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            dtype = self.options.torch_dtype(cuda=True)
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
        return build_optimizer(trainable, name=s.optimizer, lr=s.lr, weight_decay=s.weight_decay,
                               adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2)

    def _build_reference(self, path: str) -> Any:
        """The frozen reference model: same architecture and layout, weights from ``path``."""
        model, _ = build_gpt_model(read_hf_config(path), self.options, self.facts["tp_size"], self.use_te)
        model = model.to(self.device)
        self.load_hf_checkpoint(model, path)
        model.eval()
        model.requires_grad_(False)
        if self.device.type == "cuda":
            model.to("cpu")  # parked in host memory between uses
        return model

    # ---- forward ------------------------------------------------------------------------------
    def _forward_log_probs(self, model: Any, tokens: Sequence[torch.Tensor], response_lengths: Sequence[int],
                           entropy_grad: bool | None = None, routes: Sequence[torch.Tensor] | None = None,
                           row_length: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sample response-token log-probs of one packed micro-batch (differentiable) and, unless
        ``entropy_grad`` is None, their entropies (with grad only when ``entropy_grad``); ``routes``: the engine's
        routed experts per sample, replayed with ``use_rollout_routing_replay``; ``row_length``: pad the packed row
        to it (expert parallelism: :mod:`raygym.trainer.megatron_lockstep`)."""
        from megatron.core import tensor_parallel

        assert self.shape is not None
        tp_size = self.facts["tp_size"]
        packed = pack_samples(tokens, multiple=tp_size if self.options.sequence_parallel else 1,
                              with_mask=not self.use_te, length=row_length)
        ids = packed.input_ids.to(self.device)
        total = ids.shape[1]  # sequence parallel: each TP rank's routers see its slice of the row
        local = (self.facts["tp_rank"] * total // tp_size, total // tp_size) if self.options.sequence_parallel else None
        self.replay.use(routes, packed.starts, total, local)  # kept until the next micro-batch: backward recomputes
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
        logits = model(ids, packed.position_ids.to(self.device), attention_mask=mask, **kwargs)  # [1, T, V/tp]
        logits = logits.float() / float(self.settings.rollout_temperature)
        entropy = None
        if entropy_grad is not None:
            real = max(0, min(logits.shape[-1], self.shape.vocab_size - self.facts["tp_rank"] * logits.shape[-1]))
            source = logits[0] if entropy_grad else logits[0].detach()
            entropy = vocab_parallel_entropy(source, real, tp_size)
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

    def _micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """The torch backend's batching: pack by ``max_tokens_per_gpu`` or fixed ``micro_batch_size``."""
        s = self.settings
        if s.use_dynamic_batch_size:
            return pack_micro_batches(lengths, s.max_tokens_per_gpu)
        return fixed_micro_batches(len(lengths), s.micro_batch_size)

    def _dp_share(self, indices: Sequence[int]) -> list[int]:
        share = contiguous_shard(len(indices), self.facts["dp_rank"], self.facts["dp_size"])
        return [indices[i] for i in share]

    def _per_sample(self, model: Any, batch: Any, mine: list[int], with_entropy: bool) -> dict[str, dict[int, torch.Tensor]]:
        """Log-probs (and entropies) of the samples ``mine`` under ``model``, without grad, by sample index."""
        out: dict[str, dict[int, torch.Tensor]] = {"log_probs": {}, "entropy": {}}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            lengths = [int(batch.tokens[i].numel()) for i in mine]
            for mb, row in lockstep_plan(self._micro_batches(lengths), lengths, ep_size=self.facts["ep_size"]):
                if mb is None:  # a padding row: this rank takes part in the others' expert-parallel exchanges
                    self._forward_log_probs(model, [PADDING_SAMPLE], [1], row_length=row)
                    continue
                idx = [mine[j] for j in mb]
                lps, ents = self._forward_log_probs(model, [batch.tokens[i] for i in idx],
                                                    [batch.response_lengths[i] for i in idx],
                                                    entropy_grad=False if with_entropy else None,
                                                    routes=self._routes(batch, idx), row_length=row)
                for k, i in enumerate(idx):
                    out["log_probs"][i] = lps[k].float().cpu()
                    if with_entropy:
                        out["entropy"][i] = ents[k].float().cpu()
        model.train(was_training)
        return out

    def compute_log_probs(self, batch: Any, rollout_id: int = -1, *, with_entropy: bool = False) -> LogProbResult:
        """Policy (and reference) log-probs of every response token of every sample, on every rank."""
        batch = call_hook(self.settings, "custom_megatron_before_log_prob_hook", rollout_id, batch)
        mine = self._dp_share(list(range(len(batch))))
        policy = self._per_sample(self.model, batch, mine, with_entropy)
        result = {"log_probs": self._gather_over_dp(policy["log_probs"], len(batch))}
        if with_entropy:
            result["entropy"] = self._gather_over_dp(policy["entropy"], len(batch))
        if self.ref_model is not None:
            self._move_reference(self.device)
            ref = self._per_sample(self.ref_model, batch, mine, with_entropy=False)
            self._move_reference(torch.device("cpu"))
            result["ref_log_probs"] = self._gather_over_dp(ref["log_probs"], len(batch))
        return LogProbResult(**result)

    def _move_reference(self, device: torch.device) -> None:
        """On a GPU the reference model waits in host memory; it comes over for its forward passes."""
        if self.device.type == "cuda":
            self.ref_model.to(device)
            if device.type == "cpu":
                torch.cuda.empty_cache()

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
        """One rollout's optimizer steps; the loss is raygym.algo.rl_loss, metrics as the torch backend's."""
        s = self.settings
        t0 = time.perf_counter()
        batch = call_hook(s, "custom_megatron_before_train_step_hook", rollout_id, batch)
        one_step = len(optimizer_step_slices(len(batch), s.global_batch_size)) == 1
        if batch.old_log_probs is None and batch.advantages is not None and not (self.single_pass and one_step):
            batch = batch.with_log_probs(self.compute_log_probs(batch, rollout_id))
        check_policy_batch(batch, self.loss_config)
        self.model.train()
        per_step, grad_norms, lrs = [], [], []
        for step_indices in optimizer_step_slices(len(batch), s.global_batch_size):
            parts, grad_norm, lr = self._optimizer_step(batch, step_indices)
            per_step.append(parts)
            grad_norms.append(grad_norm)
            lrs.append(lr)
        metrics = step_metrics_summary(per_step, grad_norms, lrs, prefix="train",
                                       tokens=float(sum(batch.total_lengths())), seconds=time.perf_counter() - t0)
        metrics.update({**advantage_stats(batch.advantages, batch.loss_masks), **self.replay.metrics()})
        return metrics

    @staticmethod
    def _routes(batch: Any, idx: Sequence[int]) -> list[torch.Tensor] | None:
        """The engine's routed experts of samples ``idx`` (None when the batch carries none)."""
        return None if batch.routed_experts is None else [batch.routed_experts[i] for i in idx]

    def _optimizer_step(self, batch: Any, step_indices: list[int]) -> tuple[dict[str, float], float, float]:
        num_samples = len(step_indices)
        num_tokens = int(sum(float(batch.loss_masks[i].sum()) for i in step_indices))
        mine = self._dp_share(step_indices)
        self._zero_grad()
        names = self.loss_config.metric_names()
        sums = torch.zeros(len(names), dtype=torch.float64)
        # Losses are pre-divided by global sample/token counts, so micro-batch gradients add up to the full
        # batch's gradient on every data-parallel rank; the DP all-reduce must then SUM, hence * dp_size below
        # cancels Megatron's averaging.
        dp_size = self.facts["dp_size"]
        lengths = [int(batch.tokens[i].numel()) for i in mine]
        for mb, row in lockstep_plan(self._micro_batches(lengths), lengths, ep_size=self.facts["ep_size"]):
            if mb is None:  # a padding row, forward and backward (see _per_sample)
                (self._forward_log_probs(self.model, [PADDING_SAMPLE], [1], row_length=row)[0][0].sum() * 0).backward()
                continue
            loss, parts = self._micro_batch_loss(batch, [mine[j] for j in mb], num_samples, num_tokens, row)
            (loss * dp_size).backward()
            sums += torch.stack([parts[k].double().cpu() for k in names])
        lr = self.schedule.apply()
        grad_norm = self._step_optimizer()
        self.schedule.advance()
        return dict(zip(names, self._sum_over_dp(sums).tolist(), strict=True)), grad_norm, lr

    def _micro_batch_loss(self, batch: Any, idx: list[int], num_samples: int, num_tokens: int,
                          row_length: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch with raygym.algo.rl_loss, aggregated against the optimizer step's global counts."""
        from torch.nn.utils.rnn import pad_sequence

        cfg = self.loss_config
        lps, ents = self._forward_log_probs(self.model, [batch.tokens[i] for i in idx],
                                            [batch.response_lengths[i] for i in idx],
                                            entropy_grad=cfg.entropy_needs_grad, routes=self._routes(batch, idx),
                                            row_length=row_length)
        dev = lps[0].device

        def padded(values: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
            if values is None:
                return None
            return pad_sequence([values[i].to(dev, torch.float32) for i in idx], batch_first=True)

        log_probs = pad_sequence(lps, batch_first=True)
        entropy = pad_sequence(ents, batch_first=True)
        advantages, loss_mask = padded(batch.advantages), padded(batch.loss_masks)
        assert advantages is not None and loss_mask is not None  # check_policy_batch ran in train_step
        return rl_loss(log_probs, padded(batch.old_log_probs), advantages, loss_mask,
                       entropy=entropy, config=cfg, ref_log_probs=padded(batch.ref_log_probs),
                       rollout_log_probs=padded(batch.rollout_log_probs), num_samples=num_samples,
                       num_tokens=num_tokens)

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
        """CPU mode: sum grads over data-parallel replicas, global norm over TP/EP shards, clip, AdamW step."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        dense_sq = torch.zeros((), dtype=torch.float64)
        expert_sq = torch.zeros((), dtype=torch.float64)
        etp_rank, _ = self._tp_coordinates(is_expert=True)
        params = []
        for lp in self._mapped_params(self.model):
            grad = lp.param.grad
            if grad is None:
                continue
            params.append(lp.param)
            is_expert = lp.pm.expert is not None
            if self.facts["tp_size"] > 1:
                self._reduce_replicated_grad(lp, grad)
            if self.facts["dp_size"] > 1:
                group = ps.get_expert_data_parallel_group() if is_expert else ps.get_data_parallel_group()
                dist.all_reduce(grad, group=group)
            grad /= self.facts["dp_size"]
            # a TP-split tensor contributes each shard; a replicated one is counted on TP rank 0 only
            counted = lp.pm.tp_dim is not None or (etp_rank if is_expert else self.facts["tp_rank"]) == 0
            if counted:
                sq = grad.double().square().sum()
                if is_expert:
                    expert_sq += sq
                else:
                    dense_sq += sq
        if self.facts["tp_size"] > 1:
            dist.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
        if self.facts["ep_size"] > 1 or self._tp_coordinates(is_expert=True)[1] > 1:
            dist.all_reduce(expert_sq, group=ps.get_expert_tensor_and_model_parallel_group())
        norm = float((dense_sq + expert_sq).sqrt())
        clip = self.settings.clip_grad
        if clip and clip > 0 and norm > clip:
            for p in params:
                assert p.grad is not None
                p.grad.mul_(clip / (norm + 1e-6))
        self.optimizer.step()
        return norm

    def _reduce_replicated_grad(self, lp: LocalParam, grad: torch.Tensor) -> None:
        """CPU mode, TP > 1: what Megatron's ``finalize_model_grads`` does for tensors replicated over the
        tensor-parallel ranks whose gradient each rank sees only a part of: sequence-parallel norms (a
        slice of the tokens) and the per-head q/k norms (a slice of the heads) are summed; tensors marked
        ``average_gradients_across_tp_domain`` are averaged."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        name = lp.pm.megatron
        if getattr(lp.param, "average_gradients_across_tp_domain", False):
            dist.all_reduce(grad, group=group)
            grad /= self.facts["tp_size"]
        elif (self.options.sequence_parallel and getattr(lp.param, "sequence_parallel", False)) or (
            "q_layernorm" in name or "k_layernorm" in name
        ):
            dist.all_reduce(grad, group=group)

    def _sum_over_dp(self, sums: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self.facts["dp_size"] > 1:
            sums = sums.to(self.device)
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
        return sums.cpu()

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

    def checkpoint_state(self, include_optimizer: bool) -> CheckpointState:
        """This rank's blocks of the HF tensors (fp32 master weights, Adam moments), schedule and RNG."""
        from megatron.core import tensor_parallel

        from raygym.checkpoint.store import capture_rng_state

        assert self.shape is not None
        model, optim = megatron_checkpoint_state(self._mapped_params(self.model), self.optimizer, self.shape,
                                                 include_optimizer=include_optimizer)
        rng = {**capture_rng_state(), "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}
        return CheckpointState(model=model, optimizer=optim, schedule=self.schedule.state_dict(), rng=rng)

    def load_checkpoint_state(self, state: CheckpointState, load_optimizer: bool = True) -> None:
        """Restore weights, optimizer state, schedule and RNG from a filled ``checkpoint_state`` template."""
        from megatron.core import tensor_parallel

        from raygym.checkpoint.store import restore_rng_state

        assert self.shape is not None
        optim = state.optimizer if load_optimizer else None
        load_megatron_checkpoint_state(self._mapped_params(self.model), self.optimizer, self.shape, state.model, optim)
        self.schedule.load_state_dict(state.schedule)
        restore_rng_state(state.rng)
        if "megatron" in state.rng:
            tensor_parallel.get_cuda_rng_tracker().set_states(state.rng["megatron"])

    def shutdown(self) -> None:
        """Tear down Megatron's groups and this rank's process group."""
        shutdown_parallel_state()
