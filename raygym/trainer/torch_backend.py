"""The torch trainer backend: an HF causal LM, FSDP2 across ranks (gloo on CPU, nccl on GPU).

- Precision: fp32 master weights; compute in ``model.dtype`` (:func:`compute_dtype`: ``auto`` is bf16 on a
  GPU, fp32 on CPU) through FSDP2's ``MixedPrecisionPolicy`` when sharded, ``torch.autocast`` on one rank.
- Sharding: with ``WORLD_SIZE > 1`` every decoder layer (the model's ``_no_split_modules``) and then the
  root get ``fully_shard``. Gradients are summed across ranks by scaling each rank's loss by the world
  size (FSDP2 averages), so N ranks compute the same update as one.
- Micro-batches are right-padded ``[b, L]`` batches; every rank runs the same number of forward/backward
  passes (the count is all-reduced and short ranks run zero-weight dummy passes), as FSDP requires.
- Activation checkpointing (HF ``gradient_checkpointing_enable``) when ``torch_activation_checkpointing``
  is set (the recipe's ``recompute_*`` fields are Megatron's). ``attention_dropout`` goes into the HF
  config; the HF models have no hidden dropout, so ``hidden_dropout > 0`` is a ConfigError here.
- Loss: :func:`raygym.algo.rl_loss` (the one RL loss, shared with the Megatron backend).
- Checkpoints: each rank's own FSDP2 shards (DTensors of ``get_model_state_dict`` /
  ``get_optimizer_state_dict``), written by ``raygym.checkpoint.sharded`` with
  ``torch.distributed.checkpoint``; they load on any world size; resume is bit-identical on CPU. Weight sync,
  checkpoint state and HF export live in :mod:`raygym.trainer.torch_weights`.
- LoRA (``lora_rank > 0``, :mod:`raygym.trainer.lora`): the policy is the frozen base plus peft adapters; only
  the adapters are trained, synced (``iter_hf_weights``), checkpointed and exported (PEFT's adapter format), and
  the KL reference is the same model with the adapters switched off.
- Roles: ``TorchBackend`` trains the policy (``role="actor"``). The PPO critic
  (``raygym.trainer.critic.TorchCriticBackend``) subclasses it and overrides the ``_build_model``,
  ``_forward``, ``_micro_batch_loss`` family of hooks; sharding, micro-batching, gradient accumulation,
  the optimizer step, offload and checkpoints are shared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from raygym.algo.batching import (
    contiguous_shard,
    fixed_micro_batches,
    optimizer_step_slices,
    padded_micro_batches,
)
from raygym.algo.losses import entropy_from_logits
from raygym.algo.mismatch import MismatchTally
from raygym.algo.rl_loss import rl_loss
from raygym.builtin import resolve_model_path
from raygym.errors import ConfigError
from raygym.lora import LoraSpec
from raygym.trainer.backend import (
    TrainerBackend,
    TrainerSettings,
    call_hook,
    check_declared_architecture,
    check_policy_batch,
    dist_env,
    reference_model_path,
)
from raygym.trainer.batch import TrainBatch
from raygym.trainer.contract import LogProbResult, advantage_stats, step_metrics_summary
from raygym.trainer.decisions import (
    compute_dtype,
    has_active_dropout,
    reuses_current_log_probs,
    set_cpu_training_cores,
)
from raygym.trainer.optim import LrSchedule, build_optimizer, split_frozen
from raygym.trainer.routing_replay import HFRoutingReplay
from raygym.trainer.torch_weights import TorchWeights
from raygym.trainer.vision_inputs import VisionInputs
from raygym.vision.model_inputs import embed_with_images
from raygym.vision.qwen_vl import auto_model_class, is_vision_checkpoint

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from transformers import PretrainedConfig, PreTrainedModel


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute every decoder layer's activations in backward (transformers 5 name, 4.x fallback)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def pad_stack(rows: list[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad 1-D tensors to ``width`` and stack them into ``[len(rows), width]``."""
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


class TorchBackend(TorchWeights, TrainerBackend):
    """``TrainerBackend`` on HF transformers + FSDP2. See the module docstring.

    >>> # backend = TorchBackend(TrainerSettings.from_config(cfg)); backend.init()
    """

    ROLE = "actor"
    METRIC_PREFIX = "train"  # metrics are "train/<name>"; perf keys "perf/train_*"

    def __init__(self, settings: TrainerSettings, role: str = "actor") -> None:
        if role != self.ROLE:
            raise ConfigError(f"role={role!r}: {type(self).__name__} trains the {self.ROLE!r} role; for the PPO critic "
                              "use TrainerActor(settings, role='critic') (raygym.trainer.critic.TorchCriticBackend)")
        self.settings = settings
        self.role = role
        self.model: torch.nn.Module  # model, optimizer and schedule: built by init()
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer
        self.schedule: LrSchedule
        self.model_path = ""
        self.frozen: list[str] = []
        self.offloaded = False
        self.single_pass = False  # train_step may use its own detached log-probs as the old ones
        self._mismatch = MismatchTally()  # engine vs own log-probs, tallied by a single-pass train_step
        self.loss_config = settings.loss
        self.lora = LoraSpec.from_recipe(settings) if self.ROLE == "actor" else None
        self.vision: VisionInputs | None = None  # a vision-language checkpoint's image inputs (set by init)
        self.lora_targets: list[str] = []  # module paths that carry adapters
        self.reference_is_base = False  # the KL reference is this model with its adapters off
        if settings.hidden_dropout > 0.0:
            raise ConfigError(f"hidden_dropout={settings.hidden_dropout}: the torch backend's HF models have no hidden "
                              "dropout; set hidden_dropout=0 (attention_dropout works) or use trainer_backend='megatron'")

    # ---- setup -------------------------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        s = self.settings
        self.rank, self.world_size, local_rank = dist_env()
        self.device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        self.compute_dtype = compute_dtype(s.dtype, cuda=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            set_cpu_training_cores(s, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if self.device.type == "cuda" else "gloo",
                rank=self.rank,
                world_size=self.world_size,
                timeout=s.dist_timeout,
            )
        torch.manual_seed(s.seed)
        self.model_path = resolve_model_path(s.hf_checkpoint)
        self.vision = VisionInputs(self.model_path) if is_vision_checkpoint(self.model_path) else None
        self.model = self._build_model(self.model_path)
        check_declared_architecture(s, cast("PretrainedConfig", self.model.config).to_dict())
        if self.lora is not None:
            from raygym.trainer.lora import wrap_with_adapters

            self.model, self.lora_targets = wrap_with_adapters(self.model, self.lora)
        _, self.frozen = split_frozen(self.model.named_parameters(), s.freeze_params_name_list)
        self.replay = HFRoutingReplay(self.model, s.use_rollout_routing_replay and self.ROLE == "actor")  # MoE
        if s.torch_activation_checkpointing:
            self._enable_recompute()
        self._shard(self.model)
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        lr = self._base_lr()
        self.optimizer = build_optimizer(
            trainable,
            name=s.optimizer,
            lr=lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.adam_beta1,
            adam_beta2=s.adam_beta2,
        )
        decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else s.total_optimizer_steps()
        self.schedule = LrSchedule(
            self.optimizer,
            lr=lr,
            min_lr=s.min_lr,
            warmup_iters=s.lr_warmup_iters,
            decay_iters=decay_iters,
            style=s.lr_decay_style,
        )
        if s.uses_reference and self.ROLE == "actor" and self.lora is not None and not s.ref_load:
            self.reference_is_base = True  # no second copy of the weights
        elif s.uses_reference and self.ROLE == "actor":
            self.ref_model = self._load_model(reference_model_path(s, self.model_path), trainable=False)
            self._shard(self.ref_model)
            self._park_ref()
        self.single_pass = reuses_current_log_probs(s) and not has_active_dropout(self.model)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "device": str(self.device),
            "backend": "torch",
            "role": self.ROLE,
            "lr": lr,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "trainable_params": sum(p.numel() for _, p in trainable),
            "frozen": list(self.frozen),
            "reference_model": self.ref_model is not None or self.reference_is_base,
            "lora": None if self.lora is None else {"rank": self.lora.rank, "alpha": self.lora.alpha,
                                                    "targets": len(self.lora_targets)},
            "single_pass_log_probs": self.single_pass,
        }

    def _build_model(self, path: str) -> torch.nn.Module:
        """The trained model of this role, on ``self.device``, fp32, not yet sharded."""
        return self._load_model(path, trainable=True)

    def _hf_config(self, path: str) -> Any:
        """The checkpoint's HF config with the recipe's ``attention_dropout`` (ConfigError when it has none)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        if not hasattr(config, "attention_dropout") and self.settings.attention_dropout > 0.0:
            raise ConfigError(
                f"attention_dropout={self.settings.attention_dropout}: the {config.model_type} model of {path} has "
                "no attention dropout in its config; set attention_dropout=0 or use trainer_backend='megatron'"
            )
        if hasattr(config, "attention_dropout"):
            config.attention_dropout = self.settings.attention_dropout
        return config

    def _base_lr(self) -> float:
        return self.settings.lr

    def _enable_recompute(self) -> None:
        enable_activation_checkpointing(cast("PreTrainedModel", self.model))

    def _load_model(self, path: str, trainable: bool) -> torch.nn.Module:
        config = self._hf_config(path)
        model = auto_model_class(config).from_pretrained(path, config=config, dtype=torch.float32,
                                                         attn_implementation="sdpa")
        model.config.use_cache = False
        model.to(self.device)  # type: ignore[arg-type]  # transformers' decorator types `to` as unbound
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            if self.compute_dtype != torch.float32
            else MixedPrecisionPolicy()
        )
        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mp_policy=mp)
        fully_shard(model, mp_policy=mp)

    def _autocast(self):
        if self.compute_dtype != torch.float32 and self.world_size == 1:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return nullcontext()

    # ---- forward -------------------------------------------------------------------------------------
    def _forward(
        self, model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        **vision: Any,
    ) -> torch.Tensor:
        """Per-position model output for ``ids`` ``[b, L]``: logits ``[b, L, V]`` (the critic: values ``[b, L]``).
        ``vision``: a VLM's images and M-RoPE positions (:class:`raygym.trainer.vision_inputs.VisionInputs`)."""
        with self._autocast():
            if vision:
                embeds = embed_with_images(model, ids, vision.pop("image_mask"), vision.pop("pixel_values"),
                                           vision.pop("image_grid_thw"))
                return model(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False, **vision).logits
            return model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits

    def _padded_inputs(self, mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask``, both ``[b, L]`` on the device."""
        lengths = mb.total_lengths()
        ids = pad_stack(mb.tokens, max(lengths), 0).to(self.device)
        attn = pad_stack([torch.ones(n, dtype=torch.int64) for n in lengths], max(lengths), 0).to(self.device)
        return ids, attn

    def _response_positions(self, mb: TrainBatch, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows ``[b, 1]``, positions ``[b, R]``): position ``p-1+j`` is the one whose output scores
        response token ``j`` (at ``p+j``): logits predicting it, or the critic's value of that state."""
        width = max(1, max(mb.response_lengths))
        offsets = torch.arange(width, device=self.device)
        starts = torch.tensor([p - 1 for p in mb.prompt_lengths], device=self.device)
        pos = (starts[:, None] + offsets[None, :]).clamp(max=seq_len - 2)
        rows = torch.arange(len(mb), device=self.device)[:, None]
        return rows, pos

    def _response_log_probs(
        self, model: torch.nn.Module, mb: TrainBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Padded ``[b, R]`` log-probs of each sample's response tokens (and entropies) at temperature."""
        ids, attn = self._padded_inputs(mb)
        self.replay.use(mb.routed_experts, mb.total_lengths(), ids.shape[1])  # kept for recomputation in backward
        vision = (self.vision.forward_kwargs(mb.tokens, mb.prompt_lengths, mb.images, ids.shape[1], self.device)
                  if self.vision is not None and mb.images is not None else {})
        logits = self._forward(model, ids, attn, **vision)
        rows, pos = self._response_positions(mb, ids.shape[1])
        sel = logits[rows, pos].float() / self.settings.rollout_temperature
        targets = ids[rows, pos + 1]
        logp = sel.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(sel, dim=-1)
        entropy = entropy_from_logits(sel) if with_entropy else None
        return logp, entropy

    def _dummy_pass(self, model: torch.nn.Module, backward: bool) -> None:
        """A two-token pass so this rank joins the collectives of a micro-batch it does not have."""
        ids = torch.zeros(1, 2, dtype=torch.int64, device=self.device)
        self.replay.use(None)
        out = self._forward(model, ids)
        if backward:
            (out.float().sum() * 0.0).backward()

    def _max_over_ranks(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        s = self.settings
        if s.use_dynamic_batch_size:
            return padded_micro_batches(batch.total_lengths(), s.max_tokens_per_gpu)
        return fixed_micro_batches(len(batch), s.micro_batch_size)

    # ---- log-probs ---------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(
        self, batch: TrainBatch, rollout_id: int = -1, *, with_entropy: bool = False
    ) -> LogProbResult:
        batch = call_hook(self.settings, "custom_megatron_before_log_prob_hook", rollout_id, batch)
        local = batch.select(contiguous_shard(len(batch), self.rank, self.world_size))
        log_probs, entropy = self._log_probs_of(self.model, local, with_entropy)
        result: dict[str, list[torch.Tensor]] = {"log_probs": log_probs}
        if entropy is not None:
            result["entropy"] = entropy
        if self.reference_is_base:
            from raygym.trainer.lora import adapters_disabled

            with adapters_disabled(self.model):
                result["ref_log_probs"] = self._log_probs_of(self.model, local, False)[0]
        elif self.ref_model is not None:
            self._unpark_ref()
            result["ref_log_probs"] = self._log_probs_of(self.ref_model, local, False)[0]
            self._park_ref()
        return LogProbResult(**self._gather_samples(result))

    def _gather_samples(self, result: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Every rank's contiguous share concatenated in rank order, so every rank returns the whole batch."""
        if self.world_size == 1:
            return result
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, result)
        return {k: [t for part in gathered for t in part[k]] for k in result}

    def _response_rows(
        self,
        model: torch.nn.Module,
        local: TrainBatch,
        forward: Callable[[TrainBatch], dict[str, torch.Tensor]],
    ) -> dict[str, list[torch.Tensor]]:
        """Run ``forward(micro_batch) -> {name: [b, R] tensor}`` over ``local``'s micro-batches in eval mode
        (ranks kept in step with dummy passes); returns per sample 1-D float32 CPU rows of response length."""
        was_training = model.training
        model.eval()
        out: dict[str, list[Any]] = {}
        plan = self._micro_batches(local) if len(local) else []
        for k in range(self._max_over_ranks(len(plan))):
            if k >= len(plan):
                self._dummy_pass(model, backward=False)
                continue
            for name, padded in forward(local.select(plan[k])).items():
                rows = out.setdefault(name, [None] * len(local))
                for row, i in enumerate(plan[k]):
                    rows[i] = padded[row, : local.response_lengths[i]].float().cpu()
        model.train(was_training)
        return out

    def _log_probs_of(
        self, model: torch.nn.Module, local: TrainBatch, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        def forward(mb: TrainBatch) -> dict[str, torch.Tensor]:
            logp, entropy = self._response_log_probs(model, mb, with_entropy)
            return {"log_probs": logp} if entropy is None else {"log_probs": logp, "entropy": entropy}

        rows = self._response_rows(model, local, forward)
        empty: list[torch.Tensor] = []
        return rows.get("log_probs", empty), (rows.get("entropy", empty) if with_entropy else None)

    # ---- training ----------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, rollout_id: int) -> dict[str, float]:
        s = self.settings
        t0 = time.perf_counter()
        batch = self._prepare_train_batch(batch, rollout_id)
        if s.global_batch_size % self.world_size != 0:
            raise ConfigError(
                f"global_batch_size={s.global_batch_size}: must be a multiple of the {self.world_size} trainer ranks"
            )
        batch = call_hook(s, "custom_megatron_before_train_step_hook", rollout_id, batch)
        self._mismatch = MismatchTally(batch.age_buckets if batch.token_ages is not None else 0)
        self.model.train()
        per_step, grad_norms, lrs = [], [], []
        for step_indices in optimizer_step_slices(len(batch), s.global_batch_size):
            parts, grad_norm, lr = self._optimizer_step(batch.select(step_indices))
            per_step.append(parts)
            grad_norms.append(grad_norm)
            lrs.append(lr)
        metrics = step_metrics_summary(
            per_step, grad_norms, lrs, prefix=self.METRIC_PREFIX, tokens=float(sum(batch.total_lengths())),
            seconds=time.perf_counter() - t0,
        )
        if batch.old_log_probs is None and batch.rollout_log_probs is not None:  # single pass: tallied per micro-batch
            if self.world_size > 1:
                self._mismatch.all_reduce(self.device)
            metrics.update(self._mismatch.metrics())
        metrics.update({**self._role_metrics(batch), **self.replay.metrics()})
        return metrics

    def _prepare_train_batch(self, batch: TrainBatch, rollout_id: int) -> TrainBatch:
        """Check the batch carries what this role's loss needs; fill in what can be computed here."""
        s = self.settings
        one_step = len(optimizer_step_slices(len(batch), s.global_batch_size)) == 1
        if batch.old_log_probs is None and batch.advantages is not None and not (self.single_pass and one_step):
            batch = batch.with_log_probs(self.compute_log_probs(batch, rollout_id))
        check_policy_batch(batch, self.loss_config)
        return batch

    def _metric_names(self) -> tuple[str, ...]:
        """The summed metrics of ``_micro_batch_loss``, in all-reduce order."""
        return self.loss_config.metric_names()

    def _role_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """Metrics of the whole batch beside the loss's: the advantage statistics over trained tokens."""
        assert batch.advantages is not None  # check_policy_batch ran in _prepare_train_batch
        return advantage_stats(batch.advantages, batch.loss_masks)

    def _optimizer_step(self, step_batch: TrainBatch) -> tuple[dict[str, float], float, float]:
        """One optimizer step over ``step_batch`` (global), gradients accumulated over micro-batches.

        ``_micro_batch_loss`` returns the micro-batch's share of the global loss (global denominators),
        so the accumulated gradient equals that of the whole step at once."""
        s = self.settings
        per_token = self.loss_config.per_token
        num_samples = len(step_batch)  # global: every rank sees the whole step
        num_tokens = step_batch.num_loss_tokens()
        local = step_batch.shard(self.rank, self.world_size, balance=s.balance_data)
        plan = self._micro_batches(local)
        n_micro = self._max_over_ranks(len(plan))
        names = self._metric_names()
        sums = {k: torch.zeros((), dtype=torch.float64) for k in names}
        for k in range(n_micro):
            last = k == n_micro - 1
            if self.world_size > 1:
                cast("FSDPModule", self.model).set_requires_gradient_sync(last)
            if k >= len(plan):
                self._dummy_pass(self.model, backward=True)
                continue
            loss, parts = self._micro_batch_loss(local.select(plan[k]), per_token, num_samples, num_tokens)
            (loss * self.world_size).backward()
            for name, value in parts.items():
                sums[name] += float(value)
        grad_norm = self._clip_gradients()
        lr = self.schedule.apply()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.advance()
        vec = torch.stack([sums[k] for k in names])
        if self.world_size > 1:
            vec = vec.to(self.device)
            dist.all_reduce(vec)
        return {k: float(v) for k, v in zip(names, vec.cpu(), strict=True)}, grad_norm, lr

    def _micro_batch_loss(
        self, mb: TrainBatch, per_token: bool, num_samples: int, num_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.loss_config
        logp, entropy = self._response_log_probs(self.model, mb, with_entropy=True)
        assert entropy is not None and mb.advantages is not None
        if not cfg.entropy_needs_grad:
            entropy = entropy.detach()
        width = logp.shape[1]

        def pad(rows: list[torch.Tensor]) -> torch.Tensor:
            return pad_stack([r.float() for r in rows], width).to(self.device)

        def padded(rows: list[torch.Tensor] | None) -> torch.Tensor | None:
            return None if rows is None else pad(rows)

        if mb.old_log_probs is None and mb.rollout_log_probs is not None:  # single pass: old = detached logp
            self._mismatch.add(pad(mb.rollout_log_probs), logp.detach(), pad(mb.loss_masks),
                               None if mb.token_ages is None else pad(mb.token_ages).long())
        return rl_loss(
            logp, padded(mb.old_log_probs), pad(mb.advantages), pad(mb.loss_masks), entropy=entropy,
            config=cfg, ref_log_probs=padded(mb.ref_log_probs), rollout_log_probs=padded(mb.rollout_log_probs),
            num_samples=num_samples, num_tokens=num_tokens,
        )

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.settings.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.clip_grad)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ---- weights, memory, checkpoints ----------------------------------------------------------------
    def _move_optimizer_state(self, device: torch.device) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)

    def offload(self) -> None:
        """Optimizer state, then grads and params, to host memory (no-op on CPU)."""
        if self.device.type != "cuda" or self.offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self._move_optimizer_state(torch.device("cpu"))
        self.model.to("cpu")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Params first, then optimizer state, back to the GPU (no-op on CPU)."""
        if self.device.type != "cuda" or not self.offloaded:
            return
        self.model.to(self.device)
        self._move_optimizer_state(self.device)
        torch.cuda.synchronize()
        self.offloaded = False

    def _park_ref(self) -> None:
        """Keep the frozen reference model in host memory between uses on GPU."""
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to("cpu")
            torch.cuda.empty_cache()

    def _unpark_ref(self) -> None:
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to(self.device)
