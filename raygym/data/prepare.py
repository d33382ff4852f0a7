"""``raygym data prepare``: turn a raw dataset into the prompt files raygym trains on.

Sources: a local path or fsspec URL ending in ``.jsonl``/``.json``/``.csv``/``.parquet``, a
directory written by ``datasets.Dataset.save_to_disk``, ``hf:NAME`` (``datasets.load_dataset``;
needs the Hugging Face hub to be reachable, or its local cache), or ``reasoning-gym:<task>[?config]``
(``size`` items generated with ``seed``, nothing downloaded; each row's metadata carries what the task's scorer
reads, ``rm_type="reasoning_gym"``; see :mod:`raygym.envs.reasoning_gym_tasks`).

Output (the keys :class:`raygym.DatasetConfig` reads by default): ``train.jsonl`` and, with a
held-out split, ``eval.jsonl``, one object per line ``{"prompt", "label", "metadata"}``, plus
``stats.json`` (row counts, why rows were dropped, prompt lengths in characters and, given a
tokenizer, in tokens). The prompt is ``prompt_template`` filled from the row's columns (default: the
``input_key`` column as it is), optionally wrapped as chat messages or rendered with a tokenizer's
chat template.

Pure: no torch, no ray (``datasets``, ``pyarrow`` and ``transformers`` load only when a source or a
tokenizer needs them).

>>> import json, os, tempfile
>>> src = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
>>> _ = open(src, "w").write("".join(json.dumps({"q": f"{i}+1", "a": i + 1}) + "\\n" for i in range(10)))
>>> report = prepare_dataset(PrepareOptions(source=src, out_dir=os.path.dirname(src) + "/out",
...                                         input_key="q", label_key="a", eval_size=0.2))
>>> report.train_rows, report.eval_rows
(8, 2)
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raygym.errors import ConfigError

HF_PREFIX = "hf:"
FILE_FORMATS = ("jsonl", "json", "csv", "parquet")


@dataclass
class PrepareOptions:
    """What ``raygym data prepare`` does; every field is one CLI flag (``--input-key`` ...)."""

    source: str
    out_dir: str
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_keys: list[str] = field(default_factory=list)  # columns copied into each row's metadata
    prompt_template: str | None = None  # "{question}\nanswer:" (str.format over the row's columns)
    label_regex: str | None = None  # keep the first group of this match in the label ("####\\s*(\\S+)")
    system_prompt: str | None = None  # with as_messages / chat_template: a system turn first
    as_messages: bool = False  # write the prompt as [{"role": "user", ...}] (templated at train time)
    chat_template: str | None = None  # tokenizer whose chat template renders the prompt now
    tokenizer: str | None = None  # tokenizer for token statistics and max_prompt_tokens
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    eval_size: float = 0.0  # held-out rows: a fraction in (0, 1) or a count >= 1
    max_rows: int | None = None  # keep at most this many rows (after shuffling)
    seed: int = 0
    shuffle: bool = True
    file_format: str = "auto"  # auto | jsonl | json | csv | parquet
    hf_config: str | None = None  # hf: sources: the dataset's configuration ("main" for gsm8k)
    split: str = "train"  # hf: and save_to_disk sources: which split
    size: int | None = None  # reasoning-gym: sources: items to generate (default: the URI's size, else 1024)

    def validate(self) -> None:
        """Raise ConfigError naming the first bad option."""
        if not self.source:
            raise ConfigError("source='': give a file, a directory or hf:NAME to prepare")
        if not self.out_dir:
            raise ConfigError("out_dir='': set --out to the directory the prepared files go to")
        if not self.input_key:
            raise ConfigError("input_key='': set --input-key to the column holding the prompt")
        if self.label_key and self.label_key == self.input_key:
            raise ConfigError(f"label_key={self.label_key!r} equals input_key; they must name different columns")
        if self.file_format not in ("auto", *FILE_FORMATS):
            raise ConfigError(f"file_format={self.file_format!r}: use one of auto, {', '.join(FILE_FORMATS)}")
        size = self.eval_size
        if math.isnan(size) or size < 0 or (size >= 1 and size != int(size)):
            raise ConfigError(
                f"eval_size={size!r}: a fraction in (0, 1) of the rows, or a whole count >= 1; 0 = no eval split"
            )
        if self.size is not None and not self.source.startswith("reasoning-gym:"):
            raise ConfigError(f"size={self.size}: only a reasoning-gym:<task> source is generated; drop --size")
        for name in ("max_prompt_tokens", "max_prompt_chars", "max_rows", "size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value!r}: must be >= 1 (or unset)")
        if self.max_prompt_tokens is not None and not (self.tokenizer or self.chat_template):
            raise ConfigError("max_prompt_tokens needs a tokenizer: set --tokenizer (or --chat-template)")
        if self.as_messages and self.chat_template:
            raise ConfigError(
                "as_messages and chat_template both set: write messages (templated at train time) or the "
                "rendered text, not both"
            )
        if self.label_regex is not None:
            try:
                compiled = re.compile(self.label_regex)
            except re.error as exc:
                raise ConfigError(f"label_regex={self.label_regex!r}: not a valid regular expression ({exc})") from None
            if compiled.groups < 1:
                raise ConfigError(f"label_regex={self.label_regex!r}: needs one (group) marking the label to keep")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)


@dataclass
class LengthStats:
    """Summary of a list of lengths."""

    count: int
    min: int
    mean: float
    p50: int
    p95: int
    max: int

    @classmethod
    def of(cls, values: Sequence[int]) -> LengthStats | None:
        if not values:
            return None
        ordered = sorted(values)

        def quantile(q: float) -> int:
            return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

        return cls(len(ordered), ordered[0], sum(ordered) / len(ordered), quantile(0.5), quantile(0.95), ordered[-1])


@dataclass
class PrepareReport:
    """What ``prepare_dataset`` wrote (also saved as ``stats.json``)."""

    source: str
    train_path: str
    eval_path: str | None
    rows_read: int
    train_rows: int
    eval_rows: int
    dropped: dict[str, int]
    columns: list[str]
    prompt_chars: LengthStats | None
    prompt_tokens: LengthStats | None
    label_chars: LengthStats | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary_lines(self) -> list[str]:
        """Human-readable lines for the CLI."""
        lines = [f"source: {self.source} ({self.rows_read} rows; columns {', '.join(self.columns)})",
                 f"train:  {self.train_path} ({self.train_rows} rows)"]
        if self.eval_path:
            lines.append(f"eval:   {self.eval_path} ({self.eval_rows} rows, held out from train)")
        if any(self.dropped.values()):
            lines.append("dropped: " + ", ".join(f"{k}={v}" for k, v in self.dropped.items() if v))
        for name, stats in (("prompt chars", self.prompt_chars), ("prompt tokens", self.prompt_tokens),
                            ("label chars", self.label_chars)):
            if stats is not None:
                lines.append(f"{name}: min {stats.min}, mean {stats.mean:.1f}, p50 {stats.p50}, "
                             f"p95 {stats.p95}, max {stats.max}")
        return lines


def template_fields(template: str) -> list[str]:
    """The column names a ``str.format`` template reads; ConfigError for a malformed template.

    >>> template_fields("{question}\\nanswer:")
    ['question']
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(f"prompt_template={template!r}: not a valid format string ({exc}); "
                          "write columns as {name} and literal braces as {{ }}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name or not name.isidentifier():
            raise ConfigError(f"prompt_template={template!r}: placeholder {{{name}}} must name a column")
        names.append(name)
    return names


# ── reading ──────────────────────────────────────────────────────────────────────────────────────


def _format_of(source: str, requested: str) -> str:
    if requested != "auto":
        return requested
    lowered = source.lower().removesuffix(".gz")
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "json"), (".csv", "csv"), (".parquet", "parquet")):
        if lowered.endswith(suffix):
            return fmt
    raise ConfigError(f"source={source!r}: cannot tell its format from the name; name it *.jsonl, *.json, "
                      "*.csv or *.parquet, or pass --format")


def _read_json_lines(text: str, source: str) -> list[dict[str, Any]]:
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} line {line_no}: not valid JSON ({exc.msg}); each line must be one object") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{source} line {line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_file(source: str, fmt: str) -> list[dict[str, Any]]:
    import fsspec

    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with fsspec.open(source, "rb") as fh:
                return pq.read_table(fh).to_pylist()
        with fsspec.open(source, "rt", encoding="utf-8", compression="infer") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"source={source!r}: no such file; check the path or URL") from None
    if fmt == "csv":
        return [dict(row) for row in csv.DictReader(io.StringIO(text))]
    if fmt == "json":
        stripped = text.lstrip()
        if not stripped.startswith("["):
            return _read_json_lines(text, source)  # many ".json" files are JSON lines
        value = json.loads(text)
        if not all(isinstance(row, dict) for row in value):
            raise ConfigError(f"source={source!r}: a JSON array must hold objects, one per row")
        return list(value)
    return _read_json_lines(text, source)


def _read_hf(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"source='hf:{name}': needs the 'datasets' package; pip install datasets") from None
    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except ValueError as exc:  # unknown split or config
        raise ConfigError(f"source='hf:{name}' (config {config!r}, split {split!r}): {exc}") from None
    except Exception as exc:  # offline, unknown name, auth: say so plainly
        raise ConfigError(
            f"source='hf:{name}': could not load it from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc)[:300]}); check the name and --hf-config, your network, or download the files and pass "
            "the local path"
        ) from None
    return [dict(row) for row in loaded]


def _read_saved_dataset(path: str, split: str) -> list[dict[str, Any]]:
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"source={path!r}: no split {split!r} (it has {sorted(loaded)}); pass --split")
        loaded = loaded[split]
    return [dict(row) for row in loaded]


def _read_reasoning_gym(options: PrepareOptions) -> list[dict[str, Any]]:
    """A reasoning-gym task's items: columns ``prompt`` (the question), ``label`` (the answer) and
    ``reasoning_gym`` (what the scorer reads; always copied into the metadata)."""
    import dataclasses
    from urllib.parse import parse_qs, urlsplit

    from raygym.envs.reasoning_gym_tasks import METADATA_KEY, parse_task, task_rows

    spec = parse_task(options.source, "source")
    seeded = "seed" in parse_qs(urlsplit(options.source.split(":", 1)[1]).query)
    spec = dataclasses.replace(spec, size=options.size or spec.size, seed=spec.seed if seeded else options.seed)
    if METADATA_KEY not in options.metadata_keys:
        options.metadata_keys.append(METADATA_KEY)
    return [{"prompt": row["prompt"], "label": row["label"], METADATA_KEY: row["metadata"][METADATA_KEY]}
            for row in task_rows(spec, "source")]


def read_source(options: PrepareOptions) -> list[dict[str, Any]]:
    """Every row of ``options.source`` as a dict."""
    source = options.source
    if source.startswith("reasoning-gym:"):
        return _read_reasoning_gym(options)
    if source.startswith(HF_PREFIX):
        name = source[len(HF_PREFIX):]
        if not name:
            raise ConfigError("source='hf:': name the dataset, e.g. hf:openai/gsm8k")
        return _read_hf(name, options.hf_config, options.split)
    local = Path(source)
    if "://" not in source and local.is_dir():
        if (local / "dataset_info.json").exists() or (local / "dataset_dict.json").exists():
            return _read_saved_dataset(source, options.split)
        raise ConfigError(f"source={source!r}: a directory, but not one written by datasets' save_to_disk; "
                          "pass a file (jsonl/json/csv/parquet) instead")
    return _read_file(source, _format_of(source, options.file_format))


# ── shaping rows ─────────────────────────────────────────────────────────────────────────────────


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from raygym.builtin import resolve_model_path

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(path))
    except OSError as exc:
        raise ConfigError(f"tokenizer {path!r}: cannot load it ({exc}); pass a local model directory, "
                          "a Hub id or builtin:tiny-qwen3") from None


def _check_columns(rows: Sequence[Mapping[str, Any]], options: PrepareOptions, columns: list[str]) -> None:
    if not rows:
        raise ConfigError(f"source={options.source!r}: no rows")
    needed = [options.input_key] if options.prompt_template is None else template_fields(options.prompt_template)
    if options.label_key:
        needed.append(options.label_key)
    needed += options.metadata_keys
    missing = [c for c in dict.fromkeys(needed) if c not in columns]
    if missing:
        raise ConfigError(
            f"source={options.source!r}: no column {', '.join(map(repr, missing))} (columns: {', '.join(columns)}); "
            "set --input-key / --label-key / --metadata-keys / --prompt-template to existing columns"
        )


def _prompt_text(row: Mapping[str, Any], options: PrepareOptions) -> str:
    if options.prompt_template is None:
        value = row[options.input_key]
        return value if isinstance(value, str) else json.dumps(value)
    return options.prompt_template.format(**{k: ("" if v is None else v) for k, v in row.items()})


def _messages(text: str, system_prompt: str | None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*head, {"role": "user", "content": text}]


def _label(row: Mapping[str, Any], options: PrepareOptions) -> tuple[Any, bool]:
    """(label, ok): ok is False when ``label_regex`` does not match."""
    if not options.label_key:
        return None, True
    value = row[options.label_key]
    if options.label_regex is None:
        return value, True
    found = re.search(options.label_regex, str(value))
    return (found.group(1), True) if found else (None, False)


def _split_count(n: int, eval_size: float) -> int:
    if eval_size <= 0:
        return 0
    count = int(eval_size) if eval_size >= 1 else max(1, round(n * eval_size))
    if count >= n:
        raise ConfigError(f"eval_size={eval_size!r}: holds out {count} of {n} usable rows and leaves none to train "
                          "on; lower it")
    return count


def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)


def prepare_dataset(options: PrepareOptions) -> PrepareReport:
    """Read, reshape, filter, split and write ``options.source``; returns the report (also in ``stats.json``)."""
    options.validate()
    raw = read_source(options)
    columns = list(dict.fromkeys(k for row in raw[:1000] for k in row))
    _check_columns(raw, options, columns)
    order = list(range(len(raw)))
    if options.shuffle:
        random.Random(options.seed).shuffle(order)
    tokenizer_path = options.tokenizer or options.chat_template
    tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
    template_tokenizer = _load_tokenizer(options.chat_template) if options.chat_template else None
    if template_tokenizer is not None and not getattr(template_tokenizer, "chat_template", None):
        raise ConfigError(f"chat_template={options.chat_template!r}: that tokenizer has no chat template; "
                          "use --as-messages or a chat model's tokenizer")

    dropped = {"empty_prompt": 0, "label_unmatched": 0, "too_long": 0, "over_max_rows": 0}
    kept: list[dict[str, Any]] = []
    chars, tokens, label_chars = [], [], []
    for index in order:
        row = raw[index]
        text = _prompt_text(row, options)
        if not text.strip():
            dropped["empty_prompt"] += 1
            continue
        label, ok = _label(row, options)
        if not ok:
            dropped["label_unmatched"] += 1
            continue
        prompt: Any = text
        rendered = text
        if options.as_messages:
            prompt = _messages(text, options.system_prompt)
        elif template_tokenizer is not None:
            rendered = prompt = template_tokenizer.apply_chat_template(
                _messages(text, options.system_prompt), tokenize=False, add_generation_prompt=True)
        elif options.system_prompt:
            rendered = prompt = f"{options.system_prompt}\n{text}"
        if options.max_prompt_chars is not None and len(rendered) > options.max_prompt_chars:
            dropped["too_long"] += 1
            continue
        n_tokens = len(tokenizer.encode(rendered, add_special_tokens=False)) if tokenizer is not None else None
        if options.max_prompt_tokens is not None and n_tokens is not None and n_tokens > options.max_prompt_tokens:
            dropped["too_long"] += 1
            continue
        if options.max_rows is not None and len(kept) >= options.max_rows:
            dropped["over_max_rows"] += 1
            continue
        metadata = {key: row[key] for key in options.metadata_keys}
        metadata["source_index"] = index
        kept.append({"prompt": prompt, "label": label, "metadata": metadata})
        chars.append(len(rendered))
        label_chars.append(len(str(label)) if label is not None else 0)
        if n_tokens is not None:
            tokens.append(n_tokens)
    if not kept:
        raise ConfigError(f"source={options.source!r}: every one of {len(raw)} rows was dropped ({dropped}); "
                          "relax --max-prompt-tokens / --max-prompt-chars / --label-regex")
    n_eval = _split_count(len(kept), options.eval_size)
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    _write_jsonl(train_path, kept[n_eval:])
    if n_eval:
        _write_jsonl(eval_path, kept[:n_eval])
    elif eval_path.exists():
        eval_path.unlink()  # a stale split from an earlier run would look held out
    report = PrepareReport(
        source=options.source, train_path=str(train_path), eval_path=str(eval_path) if n_eval else None,
        rows_read=len(raw), train_rows=len(kept) - n_eval, eval_rows=n_eval, dropped=dropped, columns=columns,
        prompt_chars=LengthStats.of(chars), prompt_tokens=LengthStats.of(tokens),
        label_chars=LengthStats.of(label_chars) if options.label_key else None,
    )
    (out / "stats.json").write_text(json.dumps({"options": asdict(options), **report.as_dict()}, indent=2) + "\n")
    return report
