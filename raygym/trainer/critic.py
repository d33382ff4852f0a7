"""The PPO critic on the torch backend: an HF transformer body with a scalar value head.

``ValueModel`` is the body of the causal LM (``AutoModel`` from the same checkpoint as the policy, so
``lm_head`` is dropped) plus ``value_head = nn.Linear(hidden, 1)``, zero-initialised so a fresh critic
predicts 0 everywhere. Parameter names are ``model.*`` (as in the causal LM) and ``value_head.*``.

``TorchCriticBackend`` reuses ``TorchBackend``'s sharding (FSDP2 when ``WORLD_SIZE > 1``), micro-batching,
gradient accumulation, optimizer step (lr = ``critic_lr`` or ``lr``), offload and checkpoints; it changes
the model, the forward output and the loss:

- ``compute_values(batch)``: one value per response token, aligned as log-probs are: the value of
  response token ``j`` is read at position ``p-1+j`` (the state from which token ``j`` was generated).
- ``train_step(batch)``: the clipped value loss ``raygym.algo.value_loss`` against ``batch.returns``,
  clipped around the old ``batch.values`` by ``value_clip`` (``eps_clip`` when unset; 0 = no clipping),
  aggregated per sample or per token like the policy loss. Metrics are ``critic/*``.

>>> # critic = TrainerActor(TrainerSettings.from_config(cfg), role="critic"); critic.init()
>>> # batch = batch.with_log_probs(critic.compute_values(batch)).with_advantages("ppo")
>>> # metrics = critic.train_step(batch, rollout_id)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from raygym.algo.batching import contiguous_shard
from raygym.algo.losses import Aggregation, aggregate, value_loss
from raygym.errors import ConfigError
from raygym.trainer.backend import TrainerSettings, call_hook
from raygym.trainer.batch import TrainBatch
from raygym.trainer.contract import LogProbResult
from raygym.trainer.torch_backend import TorchBackend, enable_activation_checkpointing, pad_stack

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

VALUE_HEAD_PREFIX = "value_head."
CRITIC_METRICS = ("value_loss", "value_clipfrac", "value_mean")


class ValueModel(nn.Module):
    """A transformer body and a scalar head: ``forward(input_ids, attention_mask) -> values [b, L]`` (fp32).

    >>> # model = load_value_model("/path/to/hf/checkpoint", torch.device("cpu"))
    >>> # model(input_ids=torch.tensor([[3, 4, 5]])).shape == (1, 3)
    """

    def __init__(self, body: PreTrainedModel) -> None:
        super().__init__()
        self.model: PreTrainedModel = body
        self.config = body.config
        self.value_head = nn.Linear(body.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        # read by TorchBackend._shard: the decoder-layer classes that each get their own FSDP unit
        self._no_split_modules = set(getattr(body, "_no_split_modules", None) or [])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def saved_value_head(path: str) -> dict[str, torch.Tensor]:
    """``value_head.*`` tensors (prefix stripped) from the safetensors files of ``path``; empty if none."""
    from safetensors import safe_open

    head: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(VALUE_HEAD_PREFIX):
                    head[key[len(VALUE_HEAD_PREFIX) :]] = f.get_tensor(key)
    return head


def load_value_model(path: str, device: torch.device, config: PretrainedConfig | None = None) -> ValueModel:
    """A ``ValueModel`` from a local HF directory: a causal-LM checkpoint (fresh zero head) or a critic
    written by ``write_value_model`` (its trained head is restored). ``config``: the HF config to build
    the body with (default: the checkpoint's own)."""
    from transformers import AutoModel

    if config is None:
        body = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    else:
        body = AutoModel.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation="sdpa")
    body.config.use_cache = False
    model = ValueModel(body)
    head = saved_value_head(path)
    if head:
        model.value_head.load_state_dict({k: v.float() for k, v in head.items()})
    return model.to(device)


def write_value_model(state: dict[str, torch.Tensor], hf_source: str, out_url: str) -> str:
    """Write a critic as an HF-style directory (``model.safetensors`` with ``model.*`` and ``value_head.*``,
    the config and tokenizer files of ``hf_source``) to a local path or fsspec URL; ``load_value_model``
    reads it back."""
    import tempfile

    import fsspec
    from safetensors.torch import save_file

    from raygym.checkpoint.files import HF_SIDE_FILES

    fs, root = fsspec.core.url_to_fs(out_url)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    local = bool({"file", "local"} & set(protocols))
    target = Path(root if local else tempfile.mkdtemp(prefix="raygym-critic-"))
    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    for name in HF_SIDE_FILES:
        src = Path(hf_source) / name
        if src.exists():
            (target / name).write_bytes(src.read_bytes())
    if not local:
        fs.put(str(target) + "/", root, recursive=True)
        return fs.unstrip_protocol(root)
    return str(target)


def value_clip_range(settings: TrainerSettings) -> float | None:
    """The value-loss clip: ``value_clip``, or ``eps_clip`` when it is unset; None (``value_clip=0``) means
    no clipping (plain squared error)."""
    if settings.value_clip is None:
        return settings.eps_clip
    return settings.value_clip or None


class TorchCriticBackend(TorchBackend):
    """The critic role of the torch backend (see the module docstring); ``TrainerActor(role="critic")``."""

    ROLE = "critic"
    METRIC_PREFIX = "critic"

    def __init__(self, settings: TrainerSettings, role: str = "critic") -> None:
        super().__init__(settings, role=role)

    # ---- model -------------------------------------------------------------------------------------
    def _build_model(self, path: str) -> torch.nn.Module:
        return load_value_model(path, self.device, self._hf_config(path))

    def _base_lr(self) -> float:
        s = self.settings
        return s.critic_lr if s.critic_lr is not None else s.lr

    def _enable_recompute(self) -> None:
        enable_activation_checkpointing(cast(ValueModel, self.model).model)

    def _forward(
        self, model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **vision: Any
    ) -> torch.Tensor:
        assert not vision, "a critic of a vision-language model is refused before the run (raygym/run/vision_checks.py)"
        with self._autocast():
            return model(input_ids=ids, attention_mask=attention_mask)

    def _response_values(self, mb: TrainBatch) -> torch.Tensor:
        """Padded ``[b, R]`` values of each sample's response tokens (see the module docstring)."""
        ids, attn = self._padded_inputs(mb)
        values = self._forward(self.model, ids, attn)
        rows, pos = self._response_positions(mb, ids.shape[1])
        return values[rows, pos].float()

    # ---- values --------------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, rollout_id: int = -1) -> LogProbResult:
        """``values``: a 1-D float32 CPU tensor per sample, one per response token, for the whole batch.

        Each rank computes its contiguous share; the result is gathered so every rank returns all of it."""
        batch = call_hook(self.settings, "custom_megatron_before_log_prob_hook", rollout_id, batch)
        local = batch.select(contiguous_shard(len(batch), self.rank, self.world_size))
        rows = self._response_rows(self.model, local, lambda mb: {"values": self._response_values(mb)})
        return LogProbResult(**self._gather_samples({"values": rows.get("values", [])}))

    def compute_log_probs(
        self, batch: TrainBatch, rollout_id: int = -1, *, with_entropy: bool = False
    ) -> LogProbResult:
        """The backend contract's name for the forward pass: a critic returns ``values`` only."""
        return self.compute_values(batch, rollout_id)

    # ---- training ----------------------------------------------------------------------------------
    def _prepare_train_batch(self, batch: TrainBatch, rollout_id: int) -> TrainBatch:
        if batch.returns is None:
            raise ConfigError(
                "train_step (critic): the batch has no returns; compute values with compute_values, then "
                "batch.with_log_probs(values).with_advantages('ppo', ...) before training the critic"
            )
        if batch.values is None:  # the critic has not moved since the returns were computed
            batch = batch.with_log_probs(self.compute_values(batch, rollout_id))
        return batch

    def _micro_batch_loss(
        self, mb: TrainBatch, per_token: bool, num_samples: int, num_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = self._response_values(mb)
        width = values.shape[1]

        def padded(rows: list[torch.Tensor]) -> torch.Tensor:
            return pad_stack([r.float() for r in rows], width).to(self.device)

        assert mb.values is not None and mb.returns is not None  # _prepare_train_batch filled them
        mask = padded(mb.loss_masks)
        agg: Aggregation = {"per_token": per_token, "num_samples": num_samples, "num_tokens": num_tokens}
        loss, metrics = value_loss(
            values,
            padded(mb.values),
            padded(mb.returns),
            mask,
            value_clip=value_clip_range(self.settings),
            **agg,
        )
        parts = {
            "value_loss": loss.detach(),
            "value_mean": aggregate(values.detach(), mask, **agg),
            **metrics,
        }
        return loss, parts

    def _metric_names(self) -> tuple[str, ...]:
        if value_clip_range(self.settings) is None:
            return tuple(m for m in CRITIC_METRICS if m != "value_clipfrac")
        return CRITIC_METRICS

    def _role_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """Mean return over the trained tokens of the whole batch (what the values chase)."""
        assert batch.returns is not None
        trained = [r.float()[m > 0] for r, m in zip(batch.returns, batch.loss_masks, strict=True)]
        flat = torch.cat(trained) if trained else torch.zeros(0)
        return {"critic/returns_mean": float(flat.mean())} if flat.numel() else {}

    # ---- export ------------------------------------------------------------------------------------
    def _write_hf(self, state: dict[str, torch.Tensor], out_dir: str) -> None:
        write_value_model(state, self.model_path, out_dir)
