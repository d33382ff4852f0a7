"""Check prompt data before anything starts: the file exists, every row parses, the keys are there.

The driver runs :func:`check_prompt_data` on ``prompt_data`` and every eval dataset before it asks Ray
for anything, so a typo costs seconds, not a cluster start. A local file is streamed through completely
(line by line, nothing kept); a remote one (any fsspec URL but ``file://``) is read up to its first
:data:`REMOTE_ROWS_CHECKED` rows, and the rollout manager checks the rest as it loads them (its
ConfigError reaches the user the same way). Every problem is a :class:`ConfigError` naming the file,
the line, the key and the fix.

With ``image_key`` (the image column of ``multimodal_keys``), every row of a local file also has its images read,
decoded and checked against the limits of :mod:`raygym.vision.dataset`, and its prompt must name them
consistently; a remote file's first rows are checked for the column, the image count and the placeholders only
(its images are read when the data loads, and a row whose images fail there is skipped and counted).

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "rows.jsonl")
>>> _ = open(path, "w").write(json.dumps({"question": "2+2?", "answer": "4"}) + "\\n")
>>> check_prompt_data(path, input_key="question", label_key="answer").rows
1
>>> check_prompt_data(path, input_key="prompt", label_key="answer")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
raygym.errors.ConfigError: prompt_data=...rows.jsonl' line 1: no key 'prompt' for --input-key (the row has: answer, question); pass --input-key question
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from raygym.errors import ConfigError

REMOTE_ROWS_CHECKED = 1000
# Column names that usually hold the prompt, best first (suggested when --input-key is wrong).
PROMPT_LIKE = ("prompt", "question", "problem", "query", "instruction", "input", "messages", "text")
LABEL_LIKE = ("label", "answer", "solution", "ground_truth", "target", "output", "reward_model")


@dataclass(frozen=True)
class DataSummary:
    """What the check saw: ``rows`` rows (all of them when ``complete``), the first row's ``columns``."""

    url: str
    rows: int
    complete: bool
    columns: tuple[str, ...]

    def describe(self) -> str:
        """``"7473 rows"`` or ``"first 1000 rows checked"``."""
        return f"{self.rows} rows" if self.complete else f"first {self.rows} rows checked (remote)"


def _data_format(url: str, fmt: str | None, where: str) -> str:
    if fmt and fmt != "auto":
        return fmt
    lowered = url.lower()
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
        return "jsonl"
    raise ConfigError(f"{where}: cannot tell the format from the name; name it *.jsonl or *.parquet, or pass "
                      "--format jsonl (or parquet)")


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def _suggest(columns: list[str], preferred: tuple[str, ...], wrong: str) -> str | None:
    for name in preferred:
        if name in columns:
            return name
    close = difflib.get_close_matches(wrong, columns, n=1)
    return close[0] if close else None


def _jsonl_rows(url: str, where: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) per non-blank line, streamed."""
    import fsspec

    with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            text = line.rstrip("\r\n")
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{where} line {line_no}: not valid JSON ({exc.msg} at column {exc.pos + 1}); each line must "
                    f"hold one JSON object: fix or delete line {line_no}"
                ) from None


def _check_row(row: Any, line_no: int, where: str, input_key: str, label_key: str | None,
               apply_chat_template: bool) -> None:
    at = f"{where} line {line_no}"
    if not isinstance(row, Mapping):
        raise ConfigError(f"{at}: a JSON {type(row).__name__}, not an object; each line must hold one JSON "
                          "object such as {\"prompt\": ..., \"label\": ...}")
    columns = sorted(map(str, row))
    if input_key not in row:
        guess = _suggest(columns, PROMPT_LIKE, input_key)
        fix = f"pass --input-key {guess}" if guess else "pass --input-key with the column that holds the prompt"
        raise ConfigError(f"{at}: no key {input_key!r} for --input-key (the row has: {', '.join(columns)}); {fix}")
    if label_key and label_key not in row:
        guess = _suggest([c for c in columns if c != input_key], LABEL_LIKE, label_key)
        fix = f"pass --label-key {guess}" if guess else "pass --label-key with the column that holds the answer"
        raise ConfigError(f"{at}: no key {label_key!r} for --label-key (the row has: {', '.join(columns)}); {fix}, "
                          "or --no-label-key for data without labels")
    prompt = row[input_key]
    if isinstance(prompt, list) and not apply_chat_template:
        raise ConfigError(f"{at}: {input_key!r} holds chat messages (a list), not text; pass --apply-chat-template "
                          "to format them with the tokenizer's chat template")
    if not isinstance(prompt, (str, list)):
        raise ConfigError(f"{at}: {input_key!r} holds a {type(prompt).__name__}; a prompt is text or a list of "
                          "chat messages: point --input-key at the prompt column")


def _check_parquet(url: str, where: str, input_key: str, label_key: str | None,
                   image_key: str | None = None, local: bool = True) -> DataSummary:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{where}: reading parquet needs pyarrow; pip install 'raygym[parquet]'") from None
    import fsspec

    with fsspec.open(url, "rb") as fh:
        try:
            meta = pq.ParquetFile(fh)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a damaged file
            raise ConfigError(f"{where}: not a readable parquet file ({exc}); check the file") from None
        columns = list(meta.schema_arrow.names)
        rows = meta.metadata.num_rows
    fake_row = {name: "" for name in columns}  # the schema fixes the keys of every row
    _check_row(fake_row, 1, where, input_key, label_key, apply_chat_template=True)
    if rows == 0:
        raise ConfigError(f"{where}: the file has no rows; point it at a dataset with prompts")
    if image_key:
        _check_parquet_images(url, where, columns, input_key, image_key, local)
    return DataSummary(url, rows, True, tuple(columns))


def _check_parquet_images(url: str, where: str, columns: list[str], input_key: str, image_key: str,
                          local: bool) -> None:
    """Every row's images (a local file; a remote one's first :data:`REMOTE_ROWS_CHECKED` rows, not loaded)."""
    import fsspec
    import pyarrow.parquet as pq

    from raygym.vision.dataset import check_row_images, data_dir

    if image_key not in columns:
        check_row_images({c: None for c in columns}, where, column=image_key, input_key=input_key, base_dir=None)
    base = data_dir(url)
    index = 0
    with fsspec.open(url, "rb") as fh:
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=256, columns=[input_key, image_key]):
            for row in batch.to_pylist():
                if not local and index >= REMOTE_ROWS_CHECKED:
                    return
                check_row_images(row, f"{where} row {index}", column=image_key, input_key=input_key,
                                 base_dir=base, load=local)
                index += 1


def check_prompt_data(
    url: str,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    fmt: str | None = "auto",
    apply_chat_template: bool = False,
    field: str = "prompt_data",
    max_rows: int | None = None,
    image_key: str | None = None,
) -> DataSummary:
    """Check the dataset at ``url`` (a path or fsspec URL): it exists, every row (the first
    ``max_rows``; default: all of a local file, :data:`REMOTE_ROWS_CHECKED` of a remote one) is a JSON
    object with ``input_key`` (text, or chat messages with ``apply_chat_template``) and ``label_key``, and
    with ``image_key`` (``multimodal_keys``' image column) images that load (local files) and that the prompt
    names consistently. Raises :class:`ConfigError` naming ``field``, the file, the line and the fix."""
    where = f"{field}={url!r}"
    flag = "--" + field.split("[")[0].replace("_", "-")
    local = is_local(url)
    path = url.removeprefix("file://")
    if local and not os.path.exists(path):
        raise ConfigError(f"{where}: no such file (looked for {os.path.abspath(path)}); check the path given "
                          f"to {flag}")
    if local and os.path.isdir(path):
        raise ConfigError(f"{where}: is a directory; point it at a .jsonl or .parquet file")
    kind = _data_format(url, fmt, where)
    limit = max_rows if max_rows is not None else (None if local else REMOTE_ROWS_CHECKED)
    try:
        if kind == "parquet":
            return _check_parquet(url, where, input_key, label_key, image_key, local)
        rows, complete = 0, True
        columns: tuple[str, ...] = ()
        if image_key:
            from raygym.vision.dataset import check_row_images, data_dir

            base = data_dir(url)
        for line_no, row in _jsonl_rows(url, where):
            if limit is not None and rows >= limit:
                complete = False
                break
            _check_row(row, line_no, where, input_key, label_key, apply_chat_template)
            if image_key:
                check_row_images(row, f"{where} line {line_no} (row {rows})", column=image_key, input_key=input_key,
                                 base_dir=base, load=local)
            if rows == 0:
                columns = tuple(map(str, row))
            rows += 1
    except FileNotFoundError:
        raise ConfigError(f"{where}: nothing at that URL; check the path given to {flag}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); is it a jsonl file?") from None
    if rows == 0:
        raise ConfigError(f"{where}: the file has no rows; point it at a dataset with prompts")
    return DataSummary(url, rows, complete, columns)
