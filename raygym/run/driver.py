"""A run from start to end: ``train(TrainConfig) -> TrainResult``.

Checks what can be checked before Ray starts, connects to (or starts) Ray, builds the graph
(:mod:`raygym.run.graph`), resumes, runs the loop (:mod:`raygym.run.loop`: synchronous by default; ``async_mode``
overlaps the rollout of step k+1 with training on step k), exports the final weights, and releases
everything it started, also on errors and Ctrl-C.

Sampling is reproducible: the rollout manager gives every request a ``sampling_seed`` derived from
(``seed``, step, group, sample), so a run resumed from a checkpoint samples what an uninterrupted run
did (sync mode; an async resume regenerates its first step with the checkpoint's newer weights).

>>> from raygym import TrainConfig, train                   # doctest: +SKIP
>>> from raygym.presets import tiny                          # doctest: +SKIP
>>> result = train(TrainConfig(recipe=tiny(), model=..., dataset=...))   # doctest: +SKIP
>>> result.final_step, result.metrics_path                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError, RaygymError
from raygym.run.display import StepProgress, banner_lines
from raygym.run.loop import Loop
from raygym.run.metrics import (
    MetricsLogger,
    apply_substep_timing,
    loss_note,
    plot_reward_curve,
    summary_table,
)

if TYPE_CHECKING:
    from raygym.config import Recipe, TrainConfig
    from raygym.run.preflight import RunFacts

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run leaves behind."""

    run_dir: str
    metrics_path: str
    final_step: int  # last completed rollout id (-1 when no step ran)
    checkpoint_paths: list[str] = field(default_factory=list)
    hf_export_path: str | None = None
    reward_curve_path: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per step of this run
    events: list[str] = field(default_factory=list)  # phase order, see Loop.events

    def __repr__(self) -> str:
        ran = (f"steps {self.steps[0]['step']}-{self.steps[-1]['step']}" if self.steps else "no steps")
        last = self.checkpoint_paths[-1] if self.checkpoint_paths else None
        return (f"TrainResult(run_dir={self.run_dir!r}, final_step={self.final_step}, {ran} this run, "
                f"checkpoints={len(self.checkpoint_paths)} (last {last!r}), hf_export_path={self.hf_export_path!r}, "
                f"metrics_path={self.metrics_path!r})")


def _console():
    from rich.console import Console

    return Console(highlight=False)


def connect_ray(total_gpus: int, stack: ExitStack | None = None) -> bool:
    """Attach to the Ray of this process, of ``RAY_ADDRESS`` (``ray job submit``), or start a local one.

    Returns True when this call started Ray (so the run shuts it down at the end). On a machine
    without GPUs a local Ray gets ``total_gpus`` logical GPUs, so placement behaves as on a GPU node.
    A local Ray started here keeps token auth with a private token (:mod:`raygym.cluster.ray_auth`), entered on
    ``stack``, which the caller closes after ``ray.shutdown()``.
    """
    import ray

    from raygym.cluster.ray_auth import private_cluster_auth

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else total_gpus
    if stack is not None:
        stack.enter_context(private_cluster_auth())
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, 2) + total_gpus,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=os.environ.get("RAYGYM_WORKER_LOGS", "0") == "1",
    )
    return True


def _banner(cfg: TrainConfig, facts: RunFacts) -> list[str]:
    """The start-up banner (:func:`raygym.run.display.banner_lines`) with the resolved trainer backend
    and engine kind."""
    import torch

    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.trainer.actor import choose_backend

    local = not os.environ.get("RAY_ADDRESS")
    backend = cfg.recipe.check_trainer_backend() or choose_backend(cfg.recipe.trainer_backend)  # LoRA: torch
    return banner_lines(cfg, facts, trainer_backend=backend,
                        engine_kind=choose_rollout_engine(cfg.recipe.rollout_engine),
                        logical_gpus=local and not torch.cuda.is_available())


def _split_lines(recipe: Recipe, stop_after: int | None, split_note: str | None) -> list[str]:
    """The header's word on ``auto_split``: what the probe measures, or what was chosen and why."""
    if not recipe.auto_split:
        return []
    if stop_after is not None:
        return [f"split: auto; steps up to {stop_after} measure rollout and training with the split above, then "
                "the run re-picks it at a checkpoint"]
    return [f"split: {split_note}"] if split_note else []


def _resolve_reference(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """``ref_load`` (else ``model.ref_checkpoint``) as a local HF model directory, before any Ray resource:
    an unloadable one is a ConfigError, never a silent switch to the policy's weights."""
    from raygym.builtin import resolve_model_path

    source = cfg.recipe.ref_load or cfg.model.ref_checkpoint
    if not source:
        return cfg
    path = resolve_model_path(source, run_dir / "cache", seed=0)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"ref_load={source!r}: not a loadable HF model directory (no config.json there); give a local HF model "
            "directory, an fsspec URL of one or 'builtin:tiny-qwen3', or leave it empty to use the initial policy "
            "weights as the reference"
        )
    return cfg.model_copy(update={"recipe": cfg.recipe.model_copy(update={"ref_load": path})})


@contextmanager
def _sigint_deferred(console: Any) -> Iterator[None]:
    """While tearing down, a second Ctrl-C must not leave server processes and placement groups
    behind: it is reported and ignored until the release is done (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        console.print("[yellow]still releasing actors and placement groups; one moment[/]")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def train(cfg: TrainConfig) -> TrainResult:
    """Run RL post-training as described by ``cfg`` (a :class:`raygym.TrainConfig`).

    Attaches to the Ray of this process, else joins ``RAY_ADDRESS`` (``ray job submit``), else starts
    a local one; builds the graph, runs steps ``start .. num_rollout-1``, exports the final weights as
    an HF model (``<run_dir>/hf``) when the run saves checkpoints, and always releases every actor and
    placement group it started — also on Ctrl-C (re-raised as ``KeyboardInterrupt``; a checkpoint
    being written is left without its manifest, so it never counts as complete) or an actor's death
    (re-raised as :class:`raygym.errors.RaygymError` naming the actor and the last complete checkpoint).

    Hooks: ``custom_rollout_log_function(rollout_id, samples, metrics_row)`` after each step (the
    step's ``list[Sample]``; ``metrics_row`` the dict about to be logged) and
    ``custom_eval_rollout_log_function(rollout_id, samples, metrics_row)`` after each eval (samples:
    ``{dataset name: list[Sample]}``; ``metrics_row`` the ``eval/*`` dict). Either may return a dict
    of extra metrics, merged into the row.

    With ``auto_split`` the run measures its first ``auto_split_probe_steps`` steps, saves a checkpoint, picks
    the split of devices that balances rollout and training (:mod:`raygym.run.auto_split`), says what it chose
    and why (also in ``<run_dir>/split.json``), and goes on from that checkpoint with the chosen split.
    """
    if cfg.recipe.auto_split:
        return _train_auto_split(cfg)
    return _train(cfg)


def _train_auto_split(cfg: TrainConfig) -> TrainResult:
    """The probe leg, the choice, and the rest of the run from the probe's checkpoint."""
    import torch

    from raygym.checkpoint.store import latest_checkpoint
    from raygym.run.auto_split import apply_split, choose_for_run

    recipe, console = cfg.recipe, _console()
    start = recipe.start_rollout_id or 0
    resumed = latest_checkpoint(recipe.load) if recipe.load else None
    if resumed is not None:  # a resumed run re-picks from its next steps
        start = resumed.rollout_id + 1
    probe_end = start + recipe.auto_split_probe_steps - 1
    if probe_end >= recipe.num_rollout - 1:
        console.print(f"auto_split: steps {start}-{recipe.num_rollout - 1} are left, too few to measure "
                      f"{recipe.auto_split_probe_steps} and go on; the run keeps its split", markup=False)
        return _train(cfg)
    cuda, cores = torch.cuda.is_available(), len(os.sched_getaffinity(0))
    probe = _train(cfg, stop_after=probe_end)
    rows = [r for r in probe.steps if isinstance(r.get("step"), int) and start <= r["step"] <= probe_end]
    choice = choose_for_run(recipe, rows, cuda=cuda, node_cores=cores)
    record = {"step": probe_end, "reason": choice.reason(), "changed": choice.changed, "unit": choice.unit,
              "engine_devices": choice.engine_devices, "trainer_devices": choice.trainer_devices,
              "measured": {"engine_devices": choice.measured.engine_devices,
                           "trainer_devices": choice.measured.trainer_devices,
                           "rollout_s": choice.measured.rollout_s, "train_s": choice.measured.train_s},
              "predicted_step_s": choice.predicted_step_s, "measured_step_s": choice.measured_step_s,
              "even_step_s": choice.even_step_s}
    (Path(cfg.run_dir) / "split.json").write_text(json.dumps(record, indent=2) + "\n")
    console.print(f"auto_split: {choice.reason()}", markup=False, highlight=False, soft_wrap=True)
    rest = apply_split(recipe, choice, cuda=cuda).replace(load=cfg.checkpoint_dir, start_rollout_id=None)
    return _train(cfg.model_copy(update={"recipe": rest}), split_note=choice.reason())


def _train(cfg: TrainConfig, *, stop_after: int | None = None, split_note: str | None = None) -> TrainResult:
    """One leg of a run: steps up to ``num_rollout - 1``, or up to ``stop_after`` (then with a checkpoint of it,
    and neither the HF export nor the summary)."""
    started = time.monotonic()
    from raygym.run.preflight import preflight

    console = _console()
    recipe = cfg.recipe
    apply_substep_timing({}, recipe.substep_timing)  # a bad value fails before any resource is taken
    facts = preflight(cfg)  # data, rewards, model path, writable directories: ConfigError before Ray
    import ray

    from raygym.builtin import resolve_model_path
    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.run.aux_groups import preflight_judge
    from raygym.run.graph import (
        build_graph,
        config_error_of,
        last_complete_checkpoint,
        preflight_engine,
        raise_actor_death,
    )

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model.hf_checkpoint, run_dir / "cache", seed=0)
    preflight_engine(recipe, model_path)  # the engine can run the model here and take the configured weight sync
    preflight_judge(recipe, choose_rollout_engine(recipe.rollout_engine), run_dir / "cache")  # and the judge's
    if not os.environ.get("RAY_ADDRESS"):  # the trainers run here: their backend must be installed here
        from raygym.config import megatron_installed

        recipe.check_trainer_backend(megatron_installed=megatron_installed())
    for line in _banner(cfg, facts) + _split_lines(cfg.recipe, stop_after, split_note):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_checkpoint": model_path})})
    cfg = _resolve_reference(cfg, run_dir)
    recipe = cfg.recipe
    (run_dir / "config.json").write_text(json.dumps(cfg.to_json_dict(), indent=2, default=str) + "\n")

    auth = ExitStack()
    owns_ray = connect_ray(recipe.gpu_allocation().total_gpus + recipe.auxiliary_gpus(), auth)
    graph = None
    loop = None
    start = final = -1
    hf_path = None
    fast_release = True
    progress = None
    try:
        graph = build_graph(cfg, model_path, run_dir, say=console.print)
        loop = Loop(cfg, graph, console)  # raygym.run.loop
        start = loop.resume()
        with MetricsLogger(run_dir, cfg.metrics, run_id=cfg.run_id, config_dict=cfg.to_json_dict(),
                           resume_from_step=start if recipe.load else None) as metrics, \
                StepProgress(console, start, recipe.num_rollout) as progress:
            loop.progress = progress
            final = loop.run(start, metrics, stop_after)
        if loop.checkpoints and stop_after is None:
            hf_path = loop.trainers(lambda trainer: trainer.export_hf.remote(str(run_dir / "hf")))[0]
        fast_release = False
    except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
        user_error = config_error_of(exc)  # a ConfigError raised while an actor was created
        if user_error is not None:
            raise user_error from None
        raise_actor_death(exc, graph, last_complete_checkpoint(cfg.checkpoint_dir))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ConfigError):  # a user mistake found inside an actor: say it plainly
            raise exc.cause from None
        raise
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: releasing actors and placement groups[/]")
        raise
    finally:
        with _sigint_deferred(console):
            if graph is not None:
                graph.shutdown(fast=fast_release)
            if owns_ray:
                ray.shutdown()
            auth.close()

    history = loop.metrics.history if loop and loop.metrics else []
    if stop_after is not None:
        return TrainResult(run_dir=str(run_dir), metrics_path=str(run_dir / "metrics.jsonl"), final_step=final,
                           checkpoint_paths=list(loop.checkpoints) if loop else [], hf_export_path=None,
                           reward_curve_path=None, steps=list(history), events=list(loop.events) if loop else [])
    task = f"{Path(cfg.dataset.prompt_data).name}, reward {' + '.join(f.name for f in facts.rewards)}"
    curve = plot_reward_curve(history, run_dir / "reward_curve.png", title=f"raygym run {cfg.run_id} | {task}")
    if history:
        console.print(summary_table(history, title=f"raygym run {cfg.run_id}"))
        console.print(loss_note(recipe.advantage_estimator), markup=False, highlight=False, soft_wrap=True)
    if curve:
        console.print(f"reward curve: {curve}", markup=False, highlight=False, soft_wrap=True)
    if progress is not None:
        console.print(progress.final_line(start, final, str(run_dir), time.monotonic() - started),
                      markup=False, highlight=False, soft_wrap=True)
    return TrainResult(
        run_dir=str(run_dir),
        metrics_path=str(run_dir / "metrics.jsonl"),
        final_step=final,
        checkpoint_paths=list(loop.checkpoints) if loop else [],
        hf_export_path=hf_path,
        reward_curve_path=curve,
        steps=list(loop.rows) if loop else [],
        events=list(loop.events) if loop else [],
    )


__all__ = ["TrainResult", "train", "RaygymError"]
