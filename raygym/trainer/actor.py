"""``TrainerActor``: one trainer rank, Ray-agnostic (the driver wraps it with ``ray.remote``).

The backend is chosen by ``recipe.trainer_backend``: ``"torch"``, ``"megatron"``, or ``"auto"``
(:func:`choose_backend`: Megatron when the recipe asks for model parallelism, or when CUDA is present and
``megatron.core`` imports; else torch). Heavy imports happen in ``init()``.

>>> # actor = TrainerActor(TrainerSettings.from_config(cfg)); actor.init(); metrics = actor.train_step(batch, rollout_id=0)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError
from raygym.trainer.backend import TrainerBackend, TrainerSettings

if TYPE_CHECKING:
    from raygym.trainer.batch import TrainBatch
    from raygym.trainer.contract import LogProbResult

BACKENDS = ("auto", "torch", "megatron")


@dataclass
class PackedBatch:
    """A :class:`~raygym.trainer.batch.TrainBatch` as a few flat tensors, the form it crosses the Ray
    boundary in: pickling one tensor per sample and field costs ~1 ms per sample each way, packed it is
    one buffer per field. ``columns``: field name -> (1-D concatenation of the per-sample tensors,
    their lengths); ``values``: the non-tensor fields as they are.

    >>> import torch
    >>> from raygym.trainer.batch import TrainBatch
    >>> b = TrainBatch([torch.tensor([3, 4, 5]), torch.tensor([6, 7])], [2, 1], [1, 1],
    ...                [torch.ones(1), torch.ones(1)], [1.0, 0.0])
    >>> PackedBatch.pack(b).unpack().tokens[1].tolist()
    [6, 7]
    """

    columns: dict[str, tuple[Any, list[int]]]
    values: dict[str, Any]

    @classmethod
    def pack(cls, batch: TrainBatch) -> PackedBatch:
        import torch

        columns: dict[str, tuple[Any, list[int]]] = {}
        values: dict[str, Any] = {}
        for f in fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in value):
                columns[f.name] = (torch.cat(value), [v.numel() for v in value])
            else:
                values[f.name] = value
        return cls(columns, values)

    def unpack(self) -> TrainBatch:
        """The ``TrainBatch`` again; its per-sample tensors are views into one buffer per field."""
        import torch

        from raygym.trainer.batch import TrainBatch

        unpacked: dict[str, Any] = {
            name: list(torch.split(flat, lengths)) for name, (flat, lengths) in self.columns.items()
        }
        return TrainBatch(**self.values, **unpacked)


def load_checkpoint_extra(path: str) -> dict[str, Any]:
    """The ``extra.json`` of a checkpoint directory."""
    import json

    import fsspec

    with fsspec.open(path.rstrip("/") + "/extra.json", "r") as f:
        return json.load(f)


def unpacked(batch: TrainBatch | PackedBatch) -> TrainBatch:
    return batch.unpack() if isinstance(batch, PackedBatch) else batch


def choose_backend(name: str, model_parallel: bool = False) -> str:
    """Resolve ``trainer_backend`` to ``"torch"`` or ``"megatron"``. ``model_parallel``: the recipe asks for
    tensor/sequence/expert parallelism, which only Megatron runs, so ``"auto"`` is Megatron then."""
    if name not in BACKENDS:
        raise ConfigError(f"trainer_backend={name!r}: unknown backend; use one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    if model_parallel:
        return "megatron"
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("megatron") is not None:
        if importlib.util.find_spec("megatron.core") is not None:
            return "megatron"
    return "torch"


def make_backend(name: str, settings: TrainerSettings, role: str) -> TrainerBackend:
    """The backend of ``role`` (``recipe.check_trainer_backend`` first: never a silent switch to torch)."""
    from raygym.config import megatron_installed
    from raygym.config.recipe_checks import check_trainer_backend, model_parallel_requests

    if role == "critic":
        name = "torch"  # the PPO critic exists on the torch backend only (also beside a Megatron policy)
    model_parallel = False
    if role != "critic":
        if check_trainer_backend(settings, megatron_installed=megatron_installed()) == "torch":
            name = "torch"  # e.g. LoRA, which only the torch backend trains, under trainer_backend="auto"
        model_parallel = bool(model_parallel_requests(settings))
    if choose_backend(name, model_parallel=model_parallel) == "megatron":
        try:
            from raygym.trainer.megatron_backend import MegatronBackend
        except ImportError as exc:
            raise ConfigError(
                f"trainer_backend={name!r}: the Megatron backend could not be imported ({exc}); "
                "pip install 'raygym[megatron]' or set trainer_backend='torch'"
            ) from exc
        return MegatronBackend(settings, role=role)
    if role == "critic":
        from raygym.trainer.critic import TorchCriticBackend

        return TorchCriticBackend(settings, role=role)
    from raygym.trainer.torch_backend import TorchBackend

    return TorchBackend(settings, role=role)


class TrainerActor:
    """One rank of the trainer group, built from its typed view of the run's config
    (``TrainerSettings.from_config(cfg)``: the fields a trainer reads, nothing else travels to the ranks).

    ``role="critic"`` makes it a rank of the PPO critic (torch backend, ``raygym.trainer.critic``): it has
    ``compute_values`` instead of policy log-probs, trains the value loss, and checkpoints under
    ``<save dir>/critic``.
    """

    def __init__(self, settings: TrainerSettings, role: str = "actor") -> None:
        self.role = role
        self.settings = settings
        self.backend_name = settings.trainer_backend
        self.backend: TrainerBackend | None = None
        self._wsync: Any = None
        self._offloaded = False

    def init(self) -> dict[str, Any]:
        self.backend = make_backend(self.backend_name, self.settings, self.role)
        return self.backend.init()

    @property
    def _live(self) -> TrainerBackend:
        """The backend ``init`` built."""
        assert self.backend is not None, "TrainerActor.init() builds the backend first"
        return self.backend

    def get_rank(self) -> int:
        return self.backend.rank if self.backend is not None else 0

    def compute_log_probs(self, batch: TrainBatch | PackedBatch, rollout_id: int = -1) -> LogProbResult:
        """``batch``: a ``TrainBatch`` or its :class:`PackedBatch` (what the driver sends)."""
        return self._live.compute_log_probs(unpacked(batch), rollout_id)

    def train_step(self, batch: TrainBatch | PackedBatch, rollout_id: int) -> dict[str, float]:
        """``batch``: a ``TrainBatch`` or its :class:`PackedBatch` (what the driver sends)."""
        return self._live.train_step(unpacked(batch), rollout_id)

    def compute_values(self, batch: TrainBatch | PackedBatch, rollout_id: int = -1) -> LogProbResult:
        """Critic only: ``{"values": [one 1-D float32 tensor per sample, one value per response token]}``
        for the whole batch (every rank returns all of it), ready for ``batch.with_log_probs(...)``."""
        if self.role != "critic":
            raise ConfigError(
                f"compute_values: this trainer has role={self.role!r}; values come from TrainerActor(role='critic')"
            )
        from raygym.trainer.critic import TorchCriticBackend

        critic = self._live
        assert isinstance(critic, TorchCriticBackend)
        return critic.compute_values(unpacked(batch), rollout_id)

    def _role_dir(self, base: str) -> str:
        """The critic keeps its checkpoints in ``<base>/critic`` so they never mix with the policy's."""
        return base.rstrip("/") + "/critic" if self.role == "critic" else base

    def offload(self) -> None:
        self._live.offload()
        self._offloaded = True

    def onload(self) -> None:
        self._live.onload()
        self._offloaded = False

    def save_checkpoint(
        self, rollout_id: int, extra: dict[str, Any] | None = None, save_dir: str | None = None,
        commit: bool = True,
    ) -> str:
        """Save a sharded checkpoint to ``save_dir`` (default ``recipe.save``): every rank calls and writes its
        own shards (``raygym.checkpoint.sharded``). Returns the checkpoint's URL. ``commit=False``: it counts
        only after :meth:`commit_checkpoint` (the loop commits once the step's rows are written)."""
        from raygym.checkpoint.sharded import save_sharded

        target = save_dir or self.settings.save
        if not target:
            raise ConfigError("save='': no checkpoint directory; set save to a path or fsspec URL")
        backend = self._live
        state = backend.checkpoint_state(include_optimizer=not self.settings.no_save_optim)
        return save_sharded(self._role_dir(target), rollout_id, state, rank=backend.rank,
                            world_size=backend.world_size, extra=extra, hf_source=backend.model_path, commit=commit)

    def commit_checkpoint(self, url: str) -> bool:
        """Complete a checkpoint saved with ``commit=False`` (rank 0 renames its manifest into place; the
        directory is the one every rank wrote, so the trainer, not the driver, is sure to reach it)."""
        from raygym.checkpoint.files import commit_manifest

        return commit_manifest(url) if self.get_rank() == 0 else False

    def load_checkpoint(self, load_dir: str | None = None, rollout_id: int | None = None) -> dict[str, Any] | None:
        """Resume from the newest complete checkpoint in ``load_dir`` (default ``recipe.load``), or from
        the one of step ``rollout_id`` (the critic follows the policy's step, so the two never mix steps).
        A collective: every rank loads its own blocks, whatever the world size that saved them.

        Returns None when there is nothing to load, else ``{"rollout_id", "start_rollout_id", "extra",
        "path"}``; ``start_rollout_id`` follows the recipe's ``start_rollout_id`` (None = stored + 1).
        """
        from raygym.checkpoint.store import list_checkpoints, resolve_start_rollout_id

        source = load_dir or self.settings.load
        if not source:
            return None
        source = self._role_dir(source)
        done = list_checkpoints(source)
        if rollout_id is not None:
            done = [c for c in done if c.rollout_id == rollout_id]
            if not done:
                raise ConfigError(
                    f"load={source!r}: no complete {self.role} checkpoint for rollout {rollout_id}; "
                    "the policy and critic checkpoints of a step are saved together, restore both or neither"
                )
        info = done[-1] if done else None
        if info is None:
            return None
        load_optim = not self.settings.no_load_optim
        extra = self._load_into_backend(info.path, load_optim)
        start = resolve_start_rollout_id(self.settings.start_rollout_id, info.rollout_id)
        return {"rollout_id": info.rollout_id, "start_rollout_id": start, "extra": extra, "path": info.path}

    def _load_into_backend(self, path: str, load_optimizer: bool) -> dict[str, Any]:
        """Fill the backend's own state template from checkpoint ``path`` (sharded, or the older
        single-file format) and hand it to the backend; returns the checkpoint's ``extra``."""
        from raygym.checkpoint.sharded import FORMAT_SHARDED, checkpoint_format, fill_from_full, load_sharded
        from raygym.checkpoint.store import load_checkpoint

        backend = self._live
        template = backend.checkpoint_state(include_optimizer=load_optimizer)
        if checkpoint_format(path) == FORMAT_SHARDED:
            state = load_sharded(path, template, rank=backend.rank, world_size=backend.world_size,
                                 load_optimizer=load_optimizer)
            backend.load_checkpoint_state(state, load_optimizer=load_optimizer)
            return load_checkpoint_extra(path)
        ckpt = load_checkpoint(path, load_optimizer=load_optimizer)

        def missing(name: str) -> None:
            raise ConfigError(f"load={path!r}: the checkpoint has no {name}; is it a checkpoint of this model?")

        fill_from_full(template.model, ckpt.model_state, missing)
        if ckpt.optimizer_state is not None and template.optimizer is not None:
            fill_from_full(template.optimizer, ckpt.optimizer_state, missing)
        else:
            template.optimizer = None
        template.schedule, template.rng = ckpt.trainer_state["schedule"], ckpt.trainer_state["rng"]
        backend.load_checkpoint_state(template, load_optimizer=load_optimizer)
        return ckpt.extra

    def export_hf(self, path: str) -> str:
        """Write the current weights as an HF model directory (safetensors + config + tokenizer)."""
        return self._live.save_hf(path)

    # ---- weight sync (driven by raygym.weightsync.coordinator.WeightSync; every rank takes part) ----
    def init_weight_sync(self, spec: Any) -> dict[str, Any]:
        from raygym.weightsync.sender import RankWeightSync

        self._wsync = RankWeightSync(self.get_rank())
        return self._wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False, refresh_snapshot: bool = True) -> dict[str, Any]:
        return self._wsync.push(version, self._live.iter_hf_weights(), force_full, refresh_snapshot)

    def commit_weights(self, version: int) -> None:
        self._wsync.commit(version)

    def discard_weights(self) -> None:
        self._wsync.discard()

    def reconnect_weight_sync(self) -> dict[str, Any]:
        return self._wsync.reconnect()

    def use_engine_api_key(self, key: str) -> None:
        """The run's engine API key, for the weight-sync requests this rank sends."""
        from raygym.engine_api.auth import use_engine_api_key

        use_engine_api_key(key)

    def probe_log_probs(self, prompts: list[list[int]], responses: list[list[int]],
                        images: list[list[str]] | None = None) -> list[list[float]]:
        """Log-probs of ``responses`` after ``prompts`` (with each prompt's ``images``, PNG data URLs, for a
        vision-language model) under the current weights, as for training (every rank takes part; each returns
        all of them). Weight sync compares them with an engine's."""
        from raygym.trainer.batch import TrainBatch
        from raygym.types import Sample

        per_prompt = images or [[] for _ in prompts]
        samples = [Sample(prompt="", prompt_tokens=list(p), group_index=i, response_tokens=list(r), images=list(m))
                   for i, (p, r, m) in enumerate(zip(prompts, responses, per_prompt, strict=True))]
        offloaded = self._offloaded
        if offloaded:
            self.onload()
        try:
            result = self._live.compute_log_probs(TrainBatch.from_samples(samples, group_size=1))
        finally:
            if offloaded:
                self.offload()
        return [lp.float().tolist() for lp in result["log_probs"]]

    def close_weight_sync(self) -> None:
        if self._wsync is not None:
            self._wsync.close()
