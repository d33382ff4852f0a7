"""Offline evaluation of a checkpoint: ``raygym eval CHECKPOINT [--prompt-data URL] [flags]``.

It runs the training loop's own eval: rollout engines started like a run's (same placement code, same
:class:`~raygym.engines.actor.EngineActor`), and :meth:`raygym.rollout.manager.RolloutManager.evaluate`
with the run's config — the same sampling settings, per-request ``sampling_seed`` (derived from the run
``seed``, the step and the dataset), the same reward code and the same pass@k. So for the checkpoint of
step ``s`` it reproduces the in-training eval of step ``s`` exactly; ``--step`` picks the seed scope of
another step.

Settings, later wins: the run's ``config.json`` (when the checkpoint belongs to a run), then the flags
(any train flag: ``--rm-type``, ``--custom-rm-function``, ``--n-samples-per-eval-prompt``, ...).
``--prompt-data URL`` evaluates that dataset (named after its file); without it the run's eval datasets
(``--eval-prompt-data``) are used. Writes ``metrics.json``, ``samples.jsonl`` (every sample) and
``config.json`` to ``--out`` (default ``<run>/eval/<checkpoint>``) and prints a short table.

>>> plan = plan_eval("runs/my-run", ["--n-samples-per-eval-prompt", "8"])   # doctest: +SKIP
>>> result = run_eval(plan)                                                # doctest: +SKIP
>>> result.metrics["eval/next-digit/pass@8"]                               # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.checkpoint.model_source import ModelSource, resolve_model_source
from raygym.errors import ConfigError

if TYPE_CHECKING:
    from raygym.config import Recipe, TrainConfig
    from raygym.config.allocation import GpuAllocation

EVAL_OPTIONS = ("--prompt-data", "--step", "--out")


@dataclass(frozen=True)
class EvalPlan:
    """Everything an eval needs, resolved before any Ray resource is requested."""

    cfg: TrainConfig  # the run's config with the flags applied
    source: ModelSource
    rollout_id: int  # seed scope: the training step whose in-training eval this reproduces
    output_dir: str
    datasets: dict[str, str]  # name -> URL


@dataclass
class EvalResult:
    """What ``raygym eval`` leaves behind."""

    metrics: dict[str, float]  # the eval/* row (as the run logs it) plus pass@k for k = 1, 2, 4 ... n
    table: list[dict[str, Any]]  # one row per dataset, as printed
    output_dir: str
    samples_path: str
    metrics_path: str
    rollout_id: int


# ── planning (no Ray) ───────────────────────────────────────────────────────────────────────────


def take_options(args: Sequence[str], names: Sequence[str] = EVAL_OPTIONS) -> tuple[list[str], dict[str, str]]:
    """Split eval's own options (``--name VALUE`` / ``--name=VALUE``) from the train flags.

    >>> take_options(["--lr", "1", "--step=3", "--out", "d"])
    (['--lr', '1'], {'--step': '3', '--out': 'd'})
    """
    rest: list[str] = []
    found: dict[str, str] = {}
    i = 0
    while i < len(args):
        token = args[i]
        name = token.split("=", 1)[0]
        if name in names:
            if "=" in token:
                found[name] = token.split("=", 1)[1]
            elif i + 1 < len(args):
                found[name] = args[i + 1]
                i += 1
            else:
                raise ConfigError(f"{name}: needs a value")
        else:
            rest.append(token)
        i += 1
    return rest, found


def dataset_name(url: str) -> str:
    """The eval dataset name of a URL: its file name without extensions.

    >>> dataset_name("s3://bucket/gsm8k_test.jsonl"), dataset_name("builtin:next-digit")
    ('gsm8k_test', 'next-digit')
    """
    base = url.rstrip("/").rsplit("/", 1)[-1].removeprefix("builtin:")
    return base.split(".", 1)[0] or base


def _base_flags(source: ModelSource, flags: Sequence[str]) -> list[str]:
    """The run's settings as flags (or a preset matching the model), ahead of the user's flags."""
    from raygym.config import TrainConfig
    from raygym.presets import preset_name_for

    if source.run_config is not None:
        base = TrainConfig.model_validate(source.run_config).cli_args()
    else:
        preset = preset_name_for(source.name) or preset_name_for(source.hf_dir)
        base = ["--preset", preset] if preset and "--preset" not in flags else []
    if source.adapter_dir and (source.run_config or {}).get("recipe", {}).get("lora_rank", 0) <= 0:
        base += adapter_flags(source.adapter_dir)  # a bare adapter: serve it as its run did
    return [*base, "--hf-checkpoint", source.hf_dir]


def adapter_flags(adapter_dir: str) -> list[str]:
    """The ``lora_*`` flags of a PEFT adapter directory's config (rank, alpha, target modules)."""
    from raygym.lora import LoraSpec, read_adapter

    spec = LoraSpec.from_config(read_adapter(adapter_dir)[0])
    alpha = int(spec.alpha) if spec.alpha.is_integer() else spec.alpha
    return ["--lora-rank", str(spec.rank), "--lora-alpha", str(alpha),
            "--lora-target-modules", ",".join(t.rsplit(".", 1)[-1] for t in spec.target_modules)]


def plan_eval(checkpoint: str, args: Sequence[str], *, cache_dir: str | None = None) -> EvalPlan:
    """Resolve the checkpoint (exporting it to an HF directory) and the config; no Ray.

    Raises :class:`ConfigError` for a bad checkpoint, bad flags, or no eval data.
    """
    from raygym.config import TrainConfig
    from raygym.data.prompts import eval_dataset_urls
    from raygym.run.config_loading import load_train_config

    flags, own = take_options(args)
    step_text = own.get("--step")
    if step_text is not None and not step_text.strip().lstrip("-").isdigit():
        raise ConfigError(f"step={step_text!r}: must be a whole number (the training step whose eval seeds to use)")
    source = resolve_model_source(checkpoint, cache_dir)
    cfg = load_train_config([*_base_flags(source, flags), *flags])
    prompt_data = own.get("--prompt-data")
    if prompt_data:  # evaluate this dataset (and any --eval-prompt-data given too) instead of the run's
        given = load_train_config(flags).dataset.eval_prompt_data
        eval_config = {k: v for k, v in (cfg.recipe.eval_config or {}).items() if k != "datasets"}
        cfg = TrainConfig(
            recipe=cfg.recipe.replace(eval_config=eval_config or None), model=cfg.model,
            dataset=cfg.dataset.model_copy(update={
                "prompt_data": prompt_data, "eval_prompt_data": {dataset_name(prompt_data): prompt_data, **given}}),
            metrics=cfg.metrics, output_dir=cfg.output_dir, run_id=cfg.run_id,
        )
    datasets = eval_dataset_urls(cfg)
    if not datasets:
        raise ConfigError("no eval data: pass --prompt-data URL (a jsonl/parquet file, or builtin:next-digit), "
                          "or --eval-prompt-data '{\"name\": \"URL\"}'")
    rollout_id = int(step_text) if step_text is not None else (source.rollout_id or 0)
    if rollout_id < 0:
        raise ConfigError(f"step={rollout_id}: must be >= 0")
    out = own.get("--out") or _default_output_dir(source)
    return EvalPlan(cfg, source, rollout_id, out, datasets)


def _default_output_dir(source: ModelSource) -> str:
    leaf = (source.checkpoint or source.hf_dir).rstrip("/").rsplit("/", 1)[-1]
    if source.run_dir is not None:
        return f"{source.run_dir.rstrip('/')}/eval/{leaf}"
    return str(Path("runs") / "eval" / f"{leaf}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")


def engine_allocation(recipe: Recipe) -> GpuAllocation:
    """A GPU allocation holding only the recipe's rollout engines (same count and GPUs per engine).

    >>> from raygym.presets import tiny
    >>> a = engine_allocation(tiny()); (a.total_gpus, a.rollout_engines)
    (1, 1)
    """
    from raygym.config.allocation import compute_allocation

    full = recipe.gpu_allocation()
    gpus, per_node = full.rollout_gpus, full.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"rollout_num_gpus={gpus}: eval places the engines on whole nodes of {per_node} GPUs; "
                          f"pass --rollout-num-gpus as a multiple of {per_node} (or at most {per_node})")
    return compute_allocation(
        actor_num_nodes=max(1, gpus // per_node), actor_num_gpus_per_node=min(gpus, per_node), colocate=True,
        rollout_num_gpus=gpus, rollout_num_gpus_per_engine=full.rollout_num_gpus_per_engine,
    )


# ── results (pure) ──────────────────────────────────────────────────────────────────────────────


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k reported for ``n`` samples per prompt: powers of two below n, and n.

    >>> pass_ks(8), pass_ks(6), pass_ks(1)
    ([1, 2, 4, 8], [1, 2, 4, 6], [1])
    """
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def summarize(samples: Mapping[str, Sequence[Any]], n: int, pass_threshold: float,
              row: Mapping[str, float]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Extra pass@k per dataset (unbiased, :func:`raygym.rewards.scoring.pass_at_k`) and the printed table.

    ``samples`` holds each dataset's samples in prompt order, ``n`` per prompt; ``row`` is the manager's
    eval row (its keys are kept as they are)."""
    from raygym.rewards.scoring import pass_at_k

    extra: dict[str, float] = {}
    table: list[dict[str, Any]] = []
    for name, items in samples.items():
        groups = [items[i:i + n] for i in range(0, len(items), n)]
        correct = [sum(float(s.reward or 0.0) >= pass_threshold for s in g) for g in groups]
        prefix = f"eval/{name}/"
        for k in pass_ks(n):
            key = f"{prefix}pass@{k}"
            if key not in row:
                extra[key] = sum(pass_at_k(n, c, k) for c in correct) / len(groups)
        merged = {**row, **extra}
        table.append({
            "dataset": name, "prompts": len(groups), "samples": len(items),
            "reward_mean": merged[prefix + "reward_mean"],
            **{f"pass@{k}": merged[f"{prefix}pass@{k}"] for k in pass_ks(n)},
            "response_len_mean": merged[prefix + "response_len_mean"],
            "truncated_frac": merged[prefix + "truncated_frac"],
        })
    return extra, table


def sample_record(dataset: str, position: int, sample: Any) -> dict[str, Any]:
    """One line of ``samples.jsonl``."""
    return {
        "dataset": dataset, "prompt_index": position, "data_index": sample.data_index,
        "sample_index": sample.sample_index, "prompt": sample.prompt, "label": sample.label,
        "response": sample.response_text, "reward": sample.reward, "reward_error": sample.reward_error,
        "finish_reason": sample.finish_reason, "prompt_tokens": len(sample.prompt_tokens),
        "response_tokens": sample.response_length,
    }


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


def render_table(table: Sequence[Mapping[str, Any]], title: str) -> Any:
    """The printed table (a rich Table): one row per metric, one column per dataset, so it stays narrow in a
    log or pipe; a cell that still does not fit wraps onto the next line, whole, never cut to ``…``."""
    from rich.table import Table

    out = Table(title=title)
    out.add_column("metric", justify="left", overflow="fold")
    for row in table:
        out.add_column(str(row.get("dataset", "")), justify="right", overflow="fold")
    metrics = [key for key in (table[0] if table else {}) if key != "dataset"]
    for key in metrics:
        out.add_row(key, *(f"{row[key]:.4f}" if isinstance(row.get(key), float) else str(row.get(key, ""))
                           for row in table))
    return out


# ── the run ─────────────────────────────────────────────────────────────────────────────────────


async def _manager_eval(cfg: TrainConfig, handles: list[Any], model_path: str, rollout_id: int,
                        data_cache_dir: str) -> tuple[dict[str, float], dict[str, list[Any]], int, float]:
    from raygym.rollout.manager import RolloutManager

    manager = RolloutManager(cfg, handles, model_path, data_cache_dir=data_cache_dir)
    try:
        row = await manager.evaluate(rollout_id)
        return row, manager.eval_samples(), manager.settings.n_samples_per_eval_prompt, manager.pass_threshold
    finally:
        await manager.close()


def _start_engines(cfg: TrainConfig, model_path: str, log_dir: str, say: Callable[[str], None],
                   adapter_dir: str | None = None) -> tuple[Any, Any]:
    import ray

    from raygym.cluster.actor_group import start_engine_group
    from raygym.cluster.placement import allocate
    from raygym.engine_api.kinds import choose_rollout_engine
    from raygym.engines.actor import EngineActor
    from raygym.run.graph import ENGINE_START_TIMEOUT_S

    recipe = cfg.recipe
    alloc = engine_allocation(recipe)
    kind = choose_rollout_engine(recipe.rollout_engine)
    server_args: list[str] = []
    if adapter_dir:  # a LoRA checkpoint: the base model with its adapter beside it, as in training
        from raygym.engines.launch.lora import engine_lora_args
        from raygym.lora import LoraSpec, model_targets, read_adapter

        spec = LoraSpec.from_config(read_adapter(adapter_dir)[0])
        server_args = engine_lora_args(kind, spec, model_targets(model_path, spec), adapter_dir)
    placement = allocate(alloc, trainer_share=recipe.colocate_trainer_gpu_share,
                         engine_share=recipe.colocate_engine_gpu_share, timeout=recipe.placement_timeout)
    engines = None
    try:
        placement.ensure_ready()
        engines = start_engine_group(
            placement, EngineActor, args=(recipe,),
            kwargs={"model_path": model_path, "backend": kind, "log_dir": log_dir,
                    "startup_timeout": ENGINE_START_TIMEOUT_S, "extra_server_args": server_args},
            environment=recipe.environment,
        )
        say(f"starting {len(engines)} {kind} engine(s) ...")
        ray.get([h.start.remote() for h in engines.handles])
        return placement, engines
    except BaseException:
        _stop_engines(placement, engines)
        raise


def _stop_engines(placement: Any, engines: Any) -> None:
    import ray

    if engines is not None:
        try:
            ray.get([h.shutdown.remote() for h in engines.handles], timeout=60)
        finally:
            engines.kill()
    if placement is not None:
        placement.release()


def run_eval(plan: EvalPlan, say: Callable[[str], None] = print) -> EvalResult:
    """Start the engines, run the training eval once, write the outputs, release everything.

    Attaches to the Ray of this process or of ``RAY_ADDRESS`` (a Ray job), else starts a local one (and
    shuts it down at the end)."""
    import ray

    from raygym.callables import load_callable
    from raygym.run.driver import connect_ray

    cfg = plan.cfg
    out = Path(plan.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_path = plan.source.hf_dir
    data_cache = str(Path(plan.source.run_dir) / "cache") if plan.source.run_dir else str(out / "cache")
    (out / "config.json").write_text(json.dumps(cfg.to_json_dict(), indent=2, default=str) + "\n")
    say(f"eval of {plan.source.checkpoint or model_path} (seeds of step {plan.rollout_id}) -> {out}")
    owns_ray = connect_ray(engine_allocation(cfg.recipe).total_gpus)
    placement = engines = None
    try:
        placement, engines = _start_engines(cfg, model_path, str(out / "logs"), say, plan.source.adapter_dir)
        row, samples, n, threshold = asyncio.run(
            _manager_eval(cfg, list(engines.handles), model_path, plan.rollout_id, data_cache))
    finally:
        try:
            _stop_engines(placement, engines)
        finally:
            if owns_ray:
                ray.shutdown()
    hook = load_callable(cfg.recipe.custom_eval_rollout_log_function, "custom_eval_rollout_log_function")
    if hook is not None:  # as the training loop calls it after an eval
        extra_row = hook(plan.rollout_id, samples, row)
        if isinstance(extra_row, dict):
            row.update(extra_row)
    extra, table = summarize(samples, n, threshold, row)
    metrics = {**row, **extra}
    samples_path = out / "samples.jsonl"
    with samples_path.open("w") as f:
        for name, items in samples.items():
            for i, sample in enumerate(items):
                f.write(json.dumps(sample_record(name, i // n, sample), default=str) + "\n")
    metrics_path = out / "metrics.json"
    metrics_path.write_text(json.dumps({
        "step": plan.rollout_id, "checkpoint": plan.source.checkpoint, "model": model_path,
        "n_samples_per_eval_prompt": n, "seed": cfg.recipe.seed, "datasets": plan.datasets,
        "metrics": {k: _finite(v) for k, v in metrics.items()},
    }, indent=2) + "\n")
    return EvalResult(metrics, table, str(out), str(samples_path), str(metrics_path), plan.rollout_id)


__all__ = ["EvalPlan", "EvalResult", "engine_allocation", "plan_eval", "run_eval", "summarize"]
