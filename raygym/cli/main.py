"""The ``raygym`` command: ``train``, ``plan``, ``export``, ``bench``; ``serve``, ``eval``, ``report``
(in :mod:`raygym.cli.after_training`).

Every train/plan flag is generated from the config models (``raygym plan --help`` lists them).
``plan`` imports neither torch nor ray unless ``--cluster`` asks for a live cluster. Bad input
prints the ConfigError on stderr and exits with code 2.

    raygym plan --preset qwen3-4b --no-colocate
    raygym train @ run.toml --lr 1e-6
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from raygym.cli.after_training import eval_command, report_command, serve_command
from raygym.cli.bench import bench_command
from raygym.cli.help import cli_help
from raygym.cli.submit import submit as submit_command
from raygym.config import Recipe, TrainConfig, megatron_installed
from raygym.config.allocation import GpuAllocation
from raygym.errors import ConfigError, RaygymError
from raygym.run.config_loading import load_train_config

if TYPE_CHECKING:
    from raygym.cluster.layout import BundleAssignment

USAGE_ERROR = 2
_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


# ── plan rendering (pure) ────────────────────────────────────────────────────────────────────────


def _span(gpus: list[int], per_node: int) -> str:
    """'node 0: GPU 0-7' style text for global GPU indexes that lie on one or more nodes."""
    parts: list[str] = []
    for node in sorted({g // per_node for g in gpus}):
        local = [g % per_node for g in gpus if g // per_node == node]
        text = f"{local[0]}" if len(local) == 1 else f"{local[0]}-{local[-1]}"
        parts.append(f"node {node}: GPU {text}")
    return "; ".join(parts)


def allocation_rows(alloc: GpuAllocation) -> list[tuple[str, str, str]]:
    """(role, placement, note) rows: actor first, then critic, then rollout (on the actor's GPUs if colocated).

    >>> from raygym.config.allocation import compute_allocation
    >>> allocation_rows(compute_allocation(actor_num_nodes=1, actor_num_gpus_per_node=2, colocate=True))[1]
    ('engine 0', 'node 0: GPU 0', 'shares the actor GPUs')
    """
    per_node = alloc.gpus_per_node
    rows = [("actor", _span(list(range(alloc.actor_gpus)), per_node), f"{alloc.actor_gpus} GPUs")]
    cursor = alloc.actor_gpus
    if alloc.critic_gpus:
        rows.append(
            (
                "critic",
                _span(list(range(cursor, cursor + alloc.critic_gpus)), per_node),
                f"{alloc.critic_gpus} GPUs",
            )
        )
        cursor += alloc.critic_gpus
    start = 0 if alloc.colocate else cursor
    note = (
        "shares the actor GPUs"
        if alloc.colocate
        else f"{alloc.rollout_num_gpus_per_engine} GPU(s) of its own"
    )
    for engine in range(alloc.rollout_engines):
        first = start + engine * alloc.rollout_num_gpus_per_engine
        rows.append(
            (
                f"engine {engine}",
                _span(list(range(first, first + alloc.rollout_num_gpus_per_engine)), per_node),
                note,
            )
        )
    return rows


def allocation_summary(alloc: GpuAllocation) -> str:
    """One line: nodes, GPUs per role, engines, colocated or not."""
    gpus = f"{alloc.gpus_per_node} GPU{'s' if alloc.gpus_per_node != 1 else ''}"
    nodes = f"{alloc.total_nodes} node{'s' if alloc.total_nodes != 1 else ''} x {gpus}"
    layout = "colocated" if alloc.colocate else "disaggregated"
    return (
        f"{nodes}, {layout}: {alloc.actor_gpus} actor GPUs, {alloc.critic_gpus} critic GPUs, "
        f"{alloc.rollout_gpus} rollout GPUs, {alloc.rollout_engines} engines x {alloc.rollout_num_gpus_per_engine} GPU"
        f" (total nodes: {alloc.total_nodes}, total GPUs: {alloc.total_gpus})"
    )


def compact_config(cfg: TrainConfig) -> list[str]:
    """Short description of a config: model, data, run dir, and the recipe fields that differ from Recipe()."""
    defaults = Recipe().field_values()
    changed = {k: v for k, v in cfg.recipe.field_values().items() if defaults[k] != v}
    lines = [
        f"model: {cfg.model.hf_checkpoint}",
        f"dataset: {cfg.dataset.prompt_data}",
        f"run: {cfg.run_id} -> {cfg.run_dir}",
        "recipe (differences from the Qwen3-4B defaults):",
    ]
    lines += [f"  {k} = {v!r}" for k, v in changed.items()] or ["  (none)"]
    return lines


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver sees a GPU on this machine (checked without importing torch)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _note(message: str) -> None:
    click.echo(f"raygym: note: {message}", err=True)


def _print_plan(cfg: TrainConfig, cluster: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    for line in compact_config(cfg):
        console.print(line, markup=False)
    with warnings.catch_warnings(record=True) as caught:  # the resolver's remarks are notes, not warnings
        warnings.simplefilter("always")
        alloc = cfg.recipe.gpu_allocation()
    table = Table(title="GPU allocation")
    for column in ("role", "node / GPUs", "note"):
        table.add_column(column, overflow="fold")
    for row in allocation_rows(alloc):
        table.add_row(*row)
    console.print(table)
    console.print(allocation_summary(alloc), markup=False)
    for warning in caught:
        _note(str(warning.message))
    if not cluster and not has_nvidia_gpu():
        _note(f"no NVIDIA GPU here: `raygym train` on this machine starts Ray with {alloc.total_gpus} logical "
              "GPUs, so placement behaves as on GPU nodes while the work runs on the CPU")
    console.print(cfg.recipe.trainer_backend_summary(megatron_installed=megatron_installed()), markup=False)
    console.print(f"schedule: {cfg.recipe.schedule.describe()}", markup=False)
    r = cfg.recipe
    if r.auto_split:
        console.print(f"split: auto; steps up to {(r.start_rollout_id or 0) + r.auto_split_probe_steps - 1} measure "
                      "rollout and training with the split above, then the run re-picks it at a checkpoint (cores of a "
                      "node on CPU, GPUs on a cluster); `raygym plan --split-from RUN_DIR` shows a run's choice",
                      markup=False)
    if r.trainer_backend == "megatron" or r.tensor_model_parallel_size * r.expert_model_parallel_size * \
            r.pipeline_model_parallel_size * r.context_parallel_size > 1:  # which ranks form which Megatron groups
        from raygym.cluster.parallel_layout import ParallelLayout

        layout = ParallelLayout(world=r.actor_num_nodes * r.actor_num_gpus_per_node, tp=r.tensor_model_parallel_size,
                                pp=r.pipeline_model_parallel_size, cp=r.context_parallel_size,
                                ep=r.expert_model_parallel_size, num_experts=cfg.model.num_experts or 0)
        for line in layout.lines():
            console.print(line, markup=False)


# ── commands ─────────────────────────────────────────────────────────────────────────────────────


def _wants_help(args: Sequence[str]) -> bool:
    return any(a in ("--help", "-h") for a in args)


def _take_option(args: list[str], name: str) -> tuple[list[str], str | None]:
    """Remove ``name VALUE`` / ``name=VALUE`` from args; return the rest and the value."""
    rest: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        if args[i] == name and i + 1 < len(args):
            value = args[i + 1]
            i += 2
            continue
        if args[i].startswith(name + "="):
            value = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return rest, value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def app() -> None:
    """raygym: RL post-training of LLMs (GRPO, PPO, DAPO, GSPO, REINFORCE++) as one Ray graph."""


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
@click.pass_context
def plan(ctx: click.Context) -> None:
    """Resolve the config and show the GPU allocation, without starting Ray.

    Same flags as train, plus --cluster ADDRESS to place it on a live Ray cluster, and --split-from RUN_DIR
    (with --cores N on CPU) for the split of devices that the run's measured steps choose (``auto_split``).
    """
    args = list(ctx.args)
    if _wants_help(args):
        click.echo(cli_help("raygym plan [--cluster ADDRESS] [--split-from RUN_DIR [--cores N]]"))
        return
    args, cluster = _take_option(args, "--cluster")
    args, split_from = _take_option(args, "--split-from")
    args, cores = _take_option(args, "--cores")
    if split_from:
        for line in split_lines(Path(split_from), cores):
            click.echo(line)
        return
    cfg = load_train_config(args)
    _print_plan(cfg, cluster)
    if cluster:
        from rich.console import Console

        from raygym.cluster.placement import plan_on_cluster

        Console().print(render_assignments(plan_on_cluster(cfg.recipe, cluster)))


def split_lines(run_dir: Path, cores: str | None) -> list[str]:
    """What ``raygym plan --split-from RUN_DIR`` prints: the split the run's measured steps choose (of ``cores``
    cores of a node, else of the run's GPUs), why, and the flags that run it."""
    import json

    from raygym.run.auto_split import apply_split, choose_for_run

    config, metrics = run_dir / "config.json", run_dir / "metrics.jsonl"
    if not config.is_file() or not metrics.is_file():
        raise ConfigError(f"--split-from {str(run_dir)!r}: not a run directory (it needs config.json and "
                          "metrics.jsonl, which raygym train writes); pass the --output-dir of a run")
    if cores is not None and (not cores.isdigit() or int(cores) < 2):
        raise ConfigError(f"--cores {cores!r}: the cores of a node, a whole number of at least 2")
    recipe = TrainConfig.model_validate(json.loads(config.read_text())).recipe
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    cuda = cores is None
    choice = choose_for_run(recipe, rows, cuda=cuda, node_cores=int(cores or 0))
    chosen = apply_split(recipe, choice, cuda=cuda)
    flags = (f"--cpu-engine-cores {chosen.cpu_engine_cores}" if not cuda else
             f"--actor-num-nodes {chosen.actor_num_nodes} --actor-num-gpus-per-node {chosen.actor_num_gpus_per_node} "
             f"--rollout-num-gpus {chosen.rollout_num_gpus}")
    return [choice.reason(), f"flags: {flags}"]


@app.command(context_settings=_PASS_THROUGH, add_help_option=False)
@click.pass_context
def train(ctx: click.Context) -> None:
    """Train. No flags: the tiny preset on the built-in model and task (CPU, minutes)."""
    args = list(ctx.args)
    if _wants_help(args):
        click.echo(cli_help("raygym train"))
        return
    cfg = load_train_config(args)
    from raygym.run.driver import train as run_training

    result = run_training(cfg)
    for line in result_lines(result):
        click.echo(line)


def result_lines(result: object) -> list[str]:
    """What ``raygym train`` prints at the end: run dir, metrics (which steps, how many rows), the last
    checkpoint and the HF export."""
    from raygym.run.driver import TrainResult

    assert isinstance(result, TrainResult)
    metrics = Path(result.metrics_path)
    rows = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0
    ran = (f"steps {result.steps[0]['step']}-{result.steps[-1]['step']} this run" if result.steps
           else "no step this run")
    lines = [f"run directory: {result.run_dir}", f"metrics:       {result.metrics_path} ({ran}; {rows} rows)"]
    if result.checkpoint_paths:
        last = result.checkpoint_paths[-1]
        lines.append(f"checkpoint:    {last} (after step {int(last.rstrip('/').rsplit('_', 1)[-1])})")
    if result.hf_export_path:
        lines.append(f"HF export:     {result.hf_export_path}")
    return lines


@app.command()
@click.argument("checkpoint_dir")
@click.argument("out_dir")
@click.option("--merged", is_flag=True, help="LoRA runs: the adapter folded into the base model (a whole HF model) "
              "instead of the adapter alone.")
@click.option("--base", default=None, help="LoRA runs with --merged: the base model directory (default: the one "
              "the adapter names).")
def export(checkpoint_dir: str, out_dir: str, merged: bool, base: str | None) -> None:
    """Export a raygym checkpoint (an iter_* directory, or a save directory: its newest complete one) to a
    Hugging Face model directory; a LoRA run's to its adapter in PEFT's format (--merged: the merged model)."""
    from raygym.checkpoint.store import (
        checkpoint_adapter,
        checkpoint_to_export,
        export_adapter,
        export_hf,
        export_merged,
    )

    path, rollout_id = checkpoint_to_export(checkpoint_dir)
    adapter = checkpoint_adapter(path) is not None
    if (merged or base) and not adapter:
        raise ConfigError(f"--merged/--base: {path} is not a LoRA run's checkpoint (it holds the whole model); "
                          "export it without them")
    what = "the merged model" if merged else "the LoRA adapter (PEFT format)" if adapter else "the model"
    click.echo(f"exporting {what} of {path} (saved after step {rollout_id}) ...")
    if merged:
        out = export_merged(path, out_dir, base)
    else:
        out = export_adapter(path, out_dir) if adapter else export_hf(path, out_dir)
    click.echo(f"exported step {rollout_id} to {out}")


app.add_command(bench_command)  # raygym/cli/bench.py
app.add_command(serve_command)
app.add_command(eval_command)
app.add_command(report_command)
app.add_command(submit_command)

# ``raygym data prepare`` (raygym/cli/data.py)
from raygym.cli.data import data as _data_group  # noqa: E402

app.add_command(_data_group)


def render_assignments(assignments: Sequence[BundleAssignment]) -> Any:
    """A rich table (node, IP, GPU, role, rank, engine: its GPUs, share, bundle) for ``raygym plan``."""
    from rich.table import Table

    from raygym.cluster.layout import ROLES, ip_sort_key

    table = Table(title="raygym placement")
    for col in ("node", "ip", "gpu", "role", "rank", "engine: gpus", "share", "bundle"):
        numeric = col in ("gpu", "rank", "share", "bundle")
        table.add_column(col, justify="right" if numeric else "left", no_wrap=col in ("ip", "role"), overflow="fold")
    order = sorted(assignments, key=lambda a: (ip_sort_key(a.ip), a.node_id, a.gpu_id, ROLES.index(a.role)))
    for a in order:
        engine = "" if a.engine_index is None else f"{a.engine_index}: {','.join(map(str, a.engine_gpu_ids))}"
        table.add_row(
            a.node_id[:8],
            a.ip,
            str(a.gpu_id),
            a.role,
            str(a.rank),
            engine,
            f"{a.gpu_share:g}",
            str(a.bundle_index),
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``raygym`` console script; returns the exit code.

    The working directory goes on ``sys.path`` (as with ``python -m``), so ``--custom-rm-function
    my_rewards:score`` finds ``./my_rewards.py``; Ray's workers on this machine get the same path."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        # a command's ctx.exit(code) comes back as the return value here (standalone_mode=False)
        code = app.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="raygym", standalone_mode=False)
    except ConfigError as exc:
        click.echo(f"raygym: error: {exc}", err=True)
        return USAGE_ERROR
    except RaygymError as exc:
        click.echo(f"raygym: failed: {exc}", err=True)
        return 1
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
