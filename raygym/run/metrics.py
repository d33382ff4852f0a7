"""Run metrics: one JSON line per step (always), W&B and TensorBoard when configured, phase timing,
the per-step progress line, and the end-of-run summary table and reward curve.

The W&B key is read by wandb itself from ``WANDB_API_KEY`` in the environment; raygym never takes it as
an argument and never logs it.

>>> import tempfile, json, pathlib
>>> d = tempfile.mkdtemp()
>>> with MetricsLogger(d) as log:
...     row = log.log(0, {"rollout/reward_mean": 0.5})
>>> json.loads(pathlib.Path(d, "metrics.jsonl").read_text())["step"]
0
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from raygym.config.run import MetricsConfig

REQUIRED_STEP_KEYS = (
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "perf/step_time",
    "perf/rollout_time",
    "perf/train_time",
    "perf/sync_time",
)


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


def _jsonable(value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class PhaseTimer:
    """Wall-clock seconds per named phase of one step (``perf/<phase>_time``).

    >>> t = PhaseTimer()
    >>> with t.phase("rollout"):
    ...     pass
    >>> sorted(t.as_metrics())
    ['perf/rollout_time']
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_metrics(self) -> dict[str, float]:
        return {f"perf/{name}_time": round(s, 6) for name, s in self.seconds.items()}


class StepFile:
    """A jsonl file with one line per step, appended and flushed line by line (a killed run keeps every
    completed step). With ``resume_from_step`` the lines of earlier steps are kept (``kept``) and the others
    dropped; without it the file starts empty."""

    def __init__(self, path: Path, resume_from_step: int | None) -> None:
        self.path = path
        self.kept: list[dict[str, Any]] = []
        if resume_from_step is not None and path.exists():
            kept: dict[int, dict[str, Any]] = {}
            for row in self._read():  # one row per step: a step logged twice keeps its last row
                step = row.get("step")
                if isinstance(step, int) and step < resume_from_step:
                    kept[step] = row
            self.kept = [kept[s] for s in sorted(kept)]
            # a kill while rewriting must not lose the rows: a new file, renamed over the old one
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.kept))
            os.replace(tmp, path)
        elif path.exists():
            path.unlink()
        self._file = path.open("a", buffering=1)

    def _read(self) -> list[dict[str, Any]]:
        rows = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
        return rows

    def write(self, row: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def make_durable(self) -> None:
        """On disk, not only in the OS's cache (before a checkpoint vouches for these rows)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class MetricsLogger:
    """Writes ``metrics.jsonl`` in ``output_dir`` and forwards to W&B / TensorBoard when configured.

    ``metrics_config`` is a :class:`raygym.config.MetricsConfig` (or None). Lines are appended and
    flushed per step, so a killed run keeps every completed step; on resume the file is continued and
    lines of steps at or after the resume point are dropped first (so a resumed run's file equals an
    uninterrupted run's).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        metrics_config: MetricsConfig | None = None,
        *,
        run_id: str = "",
        config_dict: Mapping[str, Any] | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.steps = StepFile(self.dir / "metrics.jsonl", resume_from_step)
        self.path = self.steps.path
        self.history: list[dict[str, Any]] = list(self.steps.kept)
        # prompts.jsonl: which prompts each step trained on ({"step", "data_index": [...], "prompt_key": [...]}),
        # one line per step, under the same resume rule: a resumed run's file says what an uninterrupted one's does.
        self.prompts = StepFile(self.dir / "prompts.jsonl", resume_from_step)
        self._wandb = None
        self._tb = None
        mc = metrics_config
        if mc is not None and mc.wandb_project:
            self._wandb = self._start_wandb(mc, run_id, config_dict)
        if mc is not None and mc.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` extra

            self._tb = SummaryWriter(log_dir=str(mc.tensorboard_dir))

    @staticmethod
    def _start_wandb(mc: MetricsConfig, run_id: str, config_dict: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the extra
            from raygym.errors import ConfigError

            raise ConfigError(
                f"wandb_project={mc.wandb_project!r}: W&B logging needs the wandb package; "
                "pip install 'raygym[wandb]' (and set WANDB_API_KEY in the environment)"
            ) from e
        return wandb.init(
            project=mc.wandb_project,
            group=mc.wandb_group,
            name=mc.wandb_name or run_id or None,
            id=run_id or None,
            resume="allow",
            mode=cast(Literal["online", "offline", "disabled"], mc.wandb_mode),  # MetricsConfig checked it
            config=dict(config_dict or {}),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        values = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        row = {k: _jsonable(v) for k, v in values.items()}
        self.steps.write(row)
        self.history.append(row)
        # W&B and TensorBoard get NaN and inf as they are (a diverging loss must show there too), not as
        # metrics.jsonl spells them (null, "inf"), which is no number and would drop the point.
        numeric = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
        return row

    def log_prompts(self, step: int, data_index: list[int], prompt_key: list[int]) -> None:
        """The prompts step ``step`` trained on (one entry per group)."""
        self.prompts.write({"step": step, "data_index": data_index, "prompt_key": prompt_key})

    def make_durable(self) -> None:
        """Every row logged so far is on disk (``metrics.jsonl`` and ``prompts.jsonl``)."""
        self.steps.make_durable()
        self.prompts.make_durable()

    def close(self) -> None:
        self.steps.close()
        self.prompts.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# perf/* keys every row keeps even with substep_timing="off" (the per-phase times every run reports, plus throughput).
CORE_PERF_KEYS = frozenset({"perf/step_time", "perf/rollout_time", "perf/train_time", "perf/sync_time",
                            "perf/eval_time", "perf/tokens_per_s"})
SUBSTEP_TIMING = ("auto", "off")


def apply_substep_timing(row: Mapping[str, Any], substep_timing: str) -> dict[str, Any]:
    """``"auto"``: the row as is. ``"off"``: drop the per-substep timings (perf/* beyond
    :data:`CORE_PERF_KEYS`, e.g. ``perf/log_probs_time``, ``perf/offload_time``, ``perf/other_time``).

    >>> apply_substep_timing({"perf/step_time": 2.0, "perf/log_probs_time": 0.1, "x": 1}, "off")
    {'perf/step_time': 2.0, 'x': 1}
    """
    if substep_timing not in SUBSTEP_TIMING:
        from raygym.errors import ConfigError

        raise ConfigError(f"substep_timing={substep_timing!r}: use 'auto' or 'off'")
    if substep_timing == "auto":
        return dict(row)
    return {k: v for k, v in row.items() if not k.startswith("perf/") or k in CORE_PERF_KEYS}


def trace_record(step: int, sample: Any) -> dict[str, Any]:
    """One JSON line of ``traces/step_NNNNNN.jsonl``: where and when a sampled request ran
    (``queued``/``sent``/``done`` are Unix seconds, ``engine`` the engine index) and what it produced."""
    return {
        "step": step,
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
        "data_index": sample.data_index,
        "engine_name": sample.engine,
        "weight_version": sample.weight_version,
        "prompt_tokens": len(sample.prompt_tokens),
        "response_tokens": sample.response_length,
        "finish_reason": sample.finish_reason,
        "reward": sample.reward,
        "prompt": sample.prompt,
        "label": sample.label if isinstance(sample.label, (str, int, float, type(None))) else str(sample.label),
        "response_text": sample.response_text,
        **{k: _jsonable(v) for k, v in (sample.trace or {}).items()},
    }


def write_traces(run_dir: str | os.PathLike, step: int, samples: list[Any]) -> str | None:
    """Save the traced samples of one step (``capture_trace``) as ``<run_dir>/traces/step_NNNNNN.jsonl``;
    returns the path, or None when no sample carries a trace."""
    traced = [s for s in samples if getattr(s, "trace", None)]
    if not traced:
        return None
    path = Path(run_dir) / "traces" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(trace_record(step, s)) + "\n" for s in traced))
    return str(path)


def format_duration(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``.

    >>> format_duration(65.2), format_duration(3725)
    ('1:05', '1:02:05')
    """
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


LINE_WIDTH = 79  # per-step lines stay on one line of an 80-column terminal or log


def progress_line(row: Mapping[str, Any], num_steps: int, *, elapsed: float | None = None,
                  eta: float | None = None, width: int = LINE_WIDTH) -> str:
    """The one-line per-step summary the driver prints: the step id (numbered from 0, as in
    metrics.jsonl and the checkpoints' ``iter_*``), ``[steps done/num_steps]``, reward, response length,
    seconds per step, throughput and, when given, the time so far and the estimated time left.
    Never longer than ``width``: the spacing tightens, then throughput and elapsed time drop out.

    >>> progress_line({"step": 4, "rollout/reward_mean": 0.5, "perf/step_time": 1.25}, 10, eta=6.2)
    'step 4 [5/10]  reward 0.500  len -  1.25s/step  - tok/s  eta 0:06'
    """
    def f(key: str, fmt: str) -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

    step = int(row["step"])
    parts = [
        f"step {step} [{step + 1}/{num_steps}]",
        f"reward {f('rollout/reward_mean', '.3f')}",
        f"len {f('rollout/response_len_mean', '.1f')}",
        f"{f('perf/step_time', '.2f')}s/step",
        f"{f('perf/tokens_per_s', '.0f')} tok/s",
    ]
    if elapsed is not None:
        parts.append(f"elapsed {format_duration(elapsed)}")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    throughput = parts[4]
    tries = [("  ", parts), ("  ", [p for p in parts if p != throughput]), (" ", [p for p in parts if p != throughput]),
             (" ", [p for p in parts if p != throughput and not p.startswith("elapsed")])]
    for sep, kept in tries:
        line = sep.join(kept)
        if len(line) <= width:
            return line
    return line


# Rows of the summary table, in this order (those present in the run).
SUMMARY_KEYS = (
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "train/grad_norm",
    "train/approx_kl",
    "train/clipfrac",
    "train/entropy",
    "critic/value_loss",
    "critic/value_clipfrac",
    "critic/value_mean",
    "critic/returns_mean",
    "perf/step_time",
    "perf/tokens_per_s",
)


def loss_note(advantage_estimator: str) -> str:
    """One line printed under the summary table: what ``train/loss`` means for this estimator.

    >>> loss_note("grpo")
    'note: train/loss is ~0 by design in grpo (centred advantages at ratio 1); watch reward'
    """
    if advantage_estimator == "ppo":
        return "note: train/loss is PPO's policy loss, ~0 on fresh samples; critic/value_loss should fall"
    return f"note: train/loss is ~0 by design in {advantage_estimator} (centred advantages at ratio 1); watch reward"


def summary_table(history: Sequence[Mapping[str, Any]], title: str = "raygym run", note: str | None = None):
    """A rich Table with first/last/min/max of the main curves (reward, length, loss, critic, eval);
    ``note`` becomes its caption."""
    from rich.table import Table

    table = Table(title=title, caption=note, caption_justify="left")
    for col in ("metric", "first", "last", "min", "max"):  # a cell that does not fit wraps, whole (never "…")
        table.add_column(col, justify="right" if col != "metric" else "left", overflow="fold")
    present = {k for r in history for k in r}
    keys = [k for k in SUMMARY_KEYS if k in present]
    components = sorted(k for k in present if k.startswith("rollout/reward/"))
    if len(components) > 1:  # one function's mean is rollout/reward_mean itself
        keys[1:1] = components
    keys += sorted(k for k in present if k.startswith("eval/") and k.endswith("reward_mean"))
    for key in keys:
        values = [r[key] for r in history if isinstance(r.get(key), (int, float))]
        if values:
            table.add_row(key, *(f"{v:.4g}" for v in (values[0], values[-1], min(values), max(values))))
    return table


def plot_reward_curve(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None) -> str | None:
    """Save a PNG of reward (and eval reward) per step (the steps of metrics.jsonl, from 0; integer
    ticks) titled ``title`` (run id and task); returns its path, or None with no data."""
    steps = [r["step"] for r in history if isinstance(r.get("rollout/reward_mean"), (int, float))]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rewards = [r["rollout/reward_mean"] for r in history if isinstance(r.get("rollout/reward_mean"), (int, float))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rewards, marker="o", markersize=3, label="rollout reward (mean)")
    window = max(1, len(rewards) // 10)
    if window > 1:
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, linewidth=2, label=f"moving mean ({window} steps)")
    for key in sorted({k for r in history for k in r if k.startswith("eval/") and k.endswith("reward_mean")}):
        pts = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*pts, strict=True), marker="s", linestyle="--", label=key)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
