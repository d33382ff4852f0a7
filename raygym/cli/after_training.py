"""The commands for after training: ``raygym serve``, ``raygym eval`` and ``raygym report``.

Imported by :mod:`raygym.cli.main`; light at import (torch, ray and the web stack load inside the commands).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import click

from raygym.errors import ConfigError

EVAL_USAGE = """\
raygym eval CHECKPOINT [--prompt-data URL] [--step N] [--out DIR] [train flags]

Evaluate CHECKPOINT (a run directory, a checkpoint save directory, one checkpoint, or an HF model
directory) through the training loop's own eval: the same engines, sampling seeds, reward code and
pass@k, so the checkpoint of step N reproduces the run's eval of step N. Settings: the run's
config.json, then the flags (e.g. --rm-type, --custom-rm-function, --n-samples-per-eval-prompt k).

  --prompt-data URL   evaluate this dataset (jsonl/parquet path or URL, or builtin:next-digit) instead of
                      the run's eval datasets (--eval-prompt-data '{"name": "URL"}' adds more)
  --step N            use the sampling seeds of the run's eval at step N (default: the checkpoint's step)
  --out DIR           where metrics.json, samples.jsonl and config.json go (default <run>/eval/<checkpoint>)
"""


@click.command("serve")
@click.argument("source")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the HTTP proxy binds (0.0.0.0: all).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--route-prefix", default="/", show_default=True)
@click.option("--model-name", default=None, help="Model id clients send (default: from the checkpoint).")
@click.option("--engine", default="auto", show_default=True, type=click.Choice(["auto", "raygym", "sglang", "vllm"]),
              help="auto = SGLang where CUDA and sglang are present, else raygym's server; vllm = vLLM behind "
                   "raygym's adapter.")
@click.option("--engine-python", default=None,
              help="Interpreter that runs the engine (SGLang or vLLM installed there; default: the run's "
                   "rollout_engine_python, else this one).")
@click.option("--replicas", "num_replicas", default=1, show_default=True, type=int, help="Fixed replica count.")
@click.option("--min-replicas", default=None, type=int, help="Autoscaling lower bound (with --max-replicas).")
@click.option("--max-replicas", default=None, type=int, help="Autoscale up to this many replicas.")
@click.option("--target-ongoing-requests", default=8.0, show_default=True, type=float,
              help="Autoscaling target of in-flight requests per replica.")
@click.option("--max-ongoing-requests", default=64, show_default=True, type=int,
              help="Requests one replica takes at once.")
@click.option("--gpus-per-replica", default=None, type=int,
              help="GPUs of each replica's engine (default: 1 when the cluster has GPUs, else 0).")
@click.option("--cpus-per-replica", default=1.0, show_default=True, type=float)
@click.option("--max-replicas-per-node", default=None, type=int, help="Spread replicas over nodes.")
@click.option("--placement-strategy", default="STRICT_PACK", show_default=True,
              type=click.Choice(["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]))
@click.option("--default-max-tokens", default=256, show_default=True, type=int,
              help="Chat completions without max_tokens generate at most this many tokens.")
@click.option("--api-key-file", default=None, help="File holding the API key (default: $RAYGYM_SERVE_API_KEY).")
@click.option("--api-key", "api_key_on_argv", default=None, hidden=True)
@click.option("--detach", is_flag=True, help="On an existing cluster (RAY_ADDRESS): deploy and return.")
@click.option("--frontend", type=click.Choice(["auto", "direct", "ray-serve"]), default="auto", show_default=True,
              help="direct: one replica on this box, no Ray Serve (auto picks it for one replica and no RAY_ADDRESS).")
def serve_command(source: str, host: str, port: int, route_prefix: str, model_name: str | None, engine: str,
                  engine_python: str | None, num_replicas: int, min_replicas: int | None, max_replicas: int | None,
                  target_ongoing_requests: float, max_ongoing_requests: int, gpus_per_replica: int | None,
                  cpus_per_replica: float, max_replicas_per_node: int | None, placement_strategy: str,
                  default_max_tokens: int, api_key_file: str | None, api_key_on_argv: str | None,
                  detach: bool, frontend: str) -> None:
    """Serve SOURCE (run dir, checkpoint, or HF dir) as an OpenAI-compatible API (one box: in this process;
    several replicas or a cluster: Ray Serve).

    The API key comes from $RAYGYM_SERVE_API_KEY or --api-key-file, never from the command line.
    """
    from raygym.serve.deployment import API_KEY_ENV, ServeSettings, read_api_key, run_server

    if api_key_on_argv is not None:
        raise ConfigError(f"--api-key: keys never go on the command line (process lists, shell history); "
                          f"export {API_KEY_ENV} or use --api-key-file")
    key = read_api_key(os.environ, api_key_file, warn=lambda text: click.echo(text, err=True))
    settings = ServeSettings(
        model_dir="", model_name="", engine=engine, num_replicas=num_replicas, min_replicas=min_replicas,
        max_replicas=max_replicas, target_ongoing_requests=target_ongoing_requests,
        max_ongoing_requests=max_ongoing_requests, gpus_per_replica=gpus_per_replica,
        cpus_per_replica=cpus_per_replica, max_replicas_per_node=max_replicas_per_node,
        placement_strategy=placement_strategy, default_max_tokens=default_max_tokens, frontend=frontend,
    ).check()  # bad settings fail before the checkpoint is exported
    from dataclasses import replace

    from raygym.checkpoint.model_source import resolve_model_source

    resolved = resolve_model_source(source)
    recipe = dict((resolved.run_config or {}).get("recipe") or {})
    engine_settings = {**recipe, "sglang_max_running_requests": recipe.get("sglang_max_running_requests")
                       or max_ongoing_requests}
    if engine_python:
        engine_settings["rollout_engine_python"] = engine_python
    settings = replace(settings, model_dir=resolved.hf_dir, model_name=model_name or resolved.name,
                       engine_settings=engine_settings, adapter_dir=resolved.adapter_dir)
    click.echo(f"model: {resolved.checkpoint or resolved.hf_dir} -> {resolved.hf_dir}"
               + (f" + LoRA adapter {resolved.adapter_dir}" if resolved.adapter_dir else ""))
    click.echo(f"API key: {'from ' + api_key_file if api_key_file else 'from $' + API_KEY_ENV}")
    run_server(settings, key, host=host, port=port, route_prefix=route_prefix, detach=detach,
               say=lambda text: click.echo(text))


@click.command("eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                         "help_option_names": []}, add_help_option=False)
@click.pass_context
def eval_command(ctx: click.Context) -> None:
    """Evaluate a checkpoint with the training eval (mean reward, pass@k, every sample)."""
    args = list(ctx.args)
    if not args or args[0] in ("-h", "--help"):
        from raygym.config import format_cli_help

        click.echo(EVAL_USAGE)
        click.echo(format_cli_help("train flags"))
        return
    checkpoint, flags = args[0], args[1:]
    if checkpoint.startswith("-"):
        raise ConfigError(f"checkpoint={checkpoint!r}: put the checkpoint first: raygym eval CHECKPOINT [flags]")
    run_eval_command(checkpoint, flags)


def run_eval_command(checkpoint: str, flags: Sequence[str]) -> None:
    """``raygym eval``: plan, run, print the table and where the outputs are."""
    from rich.console import Console

    from raygym.run.evaluate import plan_eval, render_table, run_eval

    console = Console(highlight=False, soft_wrap=True)
    plan = plan_eval(checkpoint, flags)
    result = run_eval(plan, say=lambda text: console.print(text, markup=False))
    console.print(render_table(result.table, f"eval at step {result.rollout_id}: {plan.source.name}"))
    console.print(f"samples: {result.samples_path}", markup=False)
    console.print(f"metrics: {result.metrics_path}", markup=False)


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True)
@click.option("--out", default=None, help="HTML file (default: <run>/report.html for one run, else ./raygym-report.html).")
@click.option("--watch", is_flag=True, help="Rewrite the report every --interval seconds (the page reloads itself).")
@click.option("--interval", default=10.0, show_default=True, type=float, help="Seconds between rewrites with --watch.")
def report_command(run_dirs: tuple[str, ...], out: str | None, watch: bool, interval: float) -> None:
    """One self-contained HTML file comparing RUN_DIRS: config differences, curves, sampled traces."""
    from raygym.report import watch_report, write_report

    target = out or (os.path.join(run_dirs[0], "report.html") if len(run_dirs) == 1 else "raygym-report.html")
    if not watch:
        click.echo(write_report(list(run_dirs), target))
        return
    first = threading.Event()

    def written(path: str) -> None:
        if not first.is_set():
            first.set()
            click.echo(f"{path} (rewritten every {interval:g} s; Ctrl-C stops)")

    try:
        watch_report(list(run_dirs), target, interval_s=interval, on_write=written)
    except KeyboardInterrupt:
        click.echo("stopped watching")


__all__ = ["eval_command", "report_command", "serve_command"]
