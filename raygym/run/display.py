"""What a run prints: the start-up banner, one line per step (with a progress bar on a terminal), and
the closing line with the total time.

Steps are numbered from 0 everywhere (the console, ``metrics.jsonl``, the reward plot, ``iter_*``
checkpoints, resume messages): step ``k`` is the ``(k+1)``-th, and ``[k+1/N]`` beside it counts the
steps done. Piped output (a log, CI) gets plain lines without colour codes, each under 80 columns.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from raygym.run.metrics import format_duration, progress_line

if TYPE_CHECKING:
    from raygym.config import TrainConfig
    from raygym.run.preflight import RunFacts


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def reward_text(functions: list[Any]) -> list[str]:
    """One entry per reward function: ``name`` plus how it is called and its weight when summed."""
    from raygym.rewards.signatures import describe

    out = []
    for f in functions:
        how = "built-in rm_type" if f.source == "rm_type" else f"{describe(f.convention)}, {f.source}"
        weight = f" x {f.weight:g}" if len(functions) > 1 else ""
        out.append(f"{f.name}{weight} ({how})")
    return out


def banner_lines(cfg: TrainConfig, facts: RunFacts, *, trainer_backend: str, engine_kind: str, logical_gpus: bool) -> list[str]:
    """The start-up banner: run, model, data (with its row count), reward, algorithm and steps,
    trainer, engines and GPUs. ``facts`` is what :func:`raygym.run.preflight.preflight` found."""
    recipe = cfg.recipe
    alloc = recipe.gpu_allocation()
    data = facts.data
    keys = f"prompt {cfg.dataset.input_key!r}" + (f", label {cfg.dataset.label_key!r}" if cfg.dataset.label_key else "")
    lines = [
        f"raygym run {cfg.run_id}",
        f"  run dir    {cfg.run_dir}",
        f"  model      {cfg.model.hf_checkpoint}",
        f"  data       {cfg.dataset.prompt_data}: {data.describe()}; {keys}",
    ]
    for name, summary in facts.eval_data.items():
        lines.append(f"  eval       {name}: {summary.url}, {summary.describe()}, every {recipe.eval_interval} steps")
    rewards = reward_text(facts.rewards) or [  # the rollout task scores (rm_type judge or env)
        f"the judge engines ({recipe.judge_hf_checkpoint})" if recipe.rm_type == "judge"
        else f"the episode reward of {recipe.rollout_env}"]
    lines.append(f"  reward     {rewards[0]}")
    lines += [f"             + {text}" for text in rewards[1:]]
    per_step = recipe.rollout_batch_size * recipe.n_samples_per_prompt
    updates = per_step // recipe.global_batch_size
    lines.append(
        f"  algorithm  {recipe.advantage_estimator}: {recipe.rollout_batch_size} prompts x "
        f"{recipe.n_samples_per_prompt} samples = {per_step} per step, {_plural(updates, 'optimizer step')}, "
        f"lr {recipe.lr:g}"
    )
    lines.append(f"  schedule   {recipe.schedule.describe()}")
    first = recipe.start_rollout_id or 0
    lines.append(f"  steps      {first}-{recipe.num_rollout - 1} of num_rollout={recipe.num_rollout}"
                 f"{' (or after the checkpoint in --load)' if recipe.load else ''}; "
                 f"checkpoints every {recipe.save_interval} and at the end -> {cfg.checkpoint_dir}")
    critic = f" + critic on {_plural(alloc.critic_gpus, 'GPU')}" if alloc.critic_gpus else ""
    lines.append(f"  trainer    {trainer_backend} on {_plural(alloc.actor_gpus, 'GPU')}{critic}")
    if recipe.lora_rank > 0:
        names = recipe.lora_target_modules.split(",")
        targets = names[0] if len(names) == 1 else f"{len(names)} target modules"
        lines.append(f"  lora       rank {recipe.lora_rank}, alpha {recipe.lora_alpha}, {targets}; only adapters "
                     "train and sync")
    layout = "sharing the trainer's GPUs" if alloc.colocate else "on their own GPUs"
    lines.append(f"  engines    {alloc.rollout_engines} {engine_kind} engine{'' if alloc.rollout_engines == 1 else 's'} x "
                 f"{_plural(alloc.rollout_num_gpus_per_engine, 'GPU')}, {layout}")
    if logical_gpus:
        lines.append(f"  GPUs       {alloc.total_gpus} logical: no CUDA here, so Ray places the work as on a "
                     "GPU node and it runs on the CPU")
    return lines


class StepProgress:
    """Prints each step's line; on a terminal also a progress bar (steps done, elapsed, ETA) under them.

    >>> from rich.console import Console
    >>> import io
    >>> out = io.StringIO()
    >>> with StepProgress(Console(file=out), first_step=0, num_steps=2) as progress:
    ...     progress.step({"step": 0, "rollout/reward_mean": 0.5})
    >>> out.getvalue().startswith("step 0 [1/2]  reward 0.500")
    True
    """

    def __init__(self, console: Any, first_step: int, num_steps: int) -> None:
        self.console = console
        self.first_step = first_step
        self.num_steps = num_steps
        self.started = time.monotonic()
        self.steps_done = 0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> StepProgress:
        if self.console.is_terminal and self.first_step < self.num_steps:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 console=self.console, transient=True)
            self._task = self._bar.add_task("steps", total=self.num_steps, completed=self.first_step)
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step(self, row: dict[str, Any]) -> None:
        """Report a finished step (its metrics row)."""
        self.steps_done += 1
        done = int(row["step"]) + 1
        elapsed = self.elapsed
        eta = elapsed / self.steps_done * max(0, self.num_steps - done)
        if self._bar is not None:  # the bar shows elapsed and eta
            self.console.print(progress_line(row, self.num_steps, width=max(79, self.console.width - 1)),
                               soft_wrap=True, markup=False, highlight=False)
            self._bar.update(self._task, completed=done)
        else:
            self.console.print(progress_line(row, self.num_steps, elapsed=elapsed, eta=eta),
                               soft_wrap=True, markup=False, highlight=False)

    def final_line(self, first: int, last: int, run_dir: str, total_seconds: float) -> str:
        """``done: steps 0-99 (100 steps) in 2:03 (1.05 s/step); run dir runs/<id>``: the total time of
        the run (start-up included) and the mean time of its steps."""
        total = format_duration(total_seconds)
        if last < first:
            return f"done: no step ran, {total}; run dir {run_dir}"
        count = last - first + 1
        return (f"done: steps {first}-{last} ({_plural(count, 'step')}) in {total} "
                f"({self.elapsed / count:.2f} s/step); run dir {run_dir}")
