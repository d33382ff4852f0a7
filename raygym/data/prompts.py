"""Prompt datasets: rows from jsonl or parquet on any fsspec URL, templated and tokenized once.

A :class:`PromptDataset` holds every usable row already tokenized (``input_ids`` without special
tokens, which is what the engines' ``/generate`` expects) and hands out batches in a per-epoch
order that depends only on ``seed`` and the epoch number, so a run resumed from
``state_dict()`` sees exactly the prompts it would have seen.

Prompt length policy (``rollout_max_prompt_len``):

- ``"filter"`` (default): rows whose prompt is longer are dropped when the dataset loads.
- ``"truncate"``: the prompt keeps its LAST ``max_prompt_len`` tokens (the end of a templated prompt
  carries the generation prompt the model must see).

Images (``image_key``, the column ``multimodal_keys`` names; :mod:`raygym.vision.dataset`): each row's images
are loaded and checked when the dataset loads, and its prompt tokens are the widened ones (one token per merged
patch of each image), which the length policy applies to; truncation never cuts an image (a row whose cut
would is dropped and counted in ``num_image_cuts``; whole leading images cut off leave the row without them).
A row whose images cannot be used (a file gone, a URL down, too large) is skipped and counted in
``num_bad_images``, its reason kept in ``bad_image_reasons`` (the first few). Both counts are metrics of the run
(:meth:`PromptDataset.load_metrics`: ``data/num_bad_images``, ``data/num_image_cuts``, in the first step's row).

>>> import tempfile, json, os
>>> d = tempfile.mkdtemp(); p = os.path.join(d, "rows.jsonl")
>>> _ = open(p, "w").write(json.dumps({"prompt": "2+2=", "label": "4"}) + "\\n")
>>> from raygym.builtin import build_tokenizer
>>> ds = PromptDataset.from_url(p, build_tokenizer(), shuffle=False)
>>> [(r.data_index, r.prompt, r.label) for r in ds.next_batch(2)]
[(0, '2+2=', '4'), (0, '2+2=', '4')]
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from raygym.errors import ConfigError

if TYPE_CHECKING:
    from raygym.config.run import TrainConfig
    from raygym.vision.dataset import ImagePrompt

PROMPT_LEN_POLICIES = ("filter", "truncate")
BAD_IMAGE_REASONS_KEPT = 5  # reasons of skipped image rows kept for the log


class _PromptRowFields(NamedTuple):
    data_index: int  # row number in the source file (0-based, before any filtering)
    prompt: Any  # the raw input: a string or a list of chat messages
    label: Any
    metadata: dict[str, Any]
    prompt_tokens: list[int]


class PromptRow(_PromptRowFields):
    """One prompt handed to the rollout: unpacks as ``(data_index, prompt, label, metadata, prompt_tokens)``.

    ``columns`` (an attribute, not part of the tuple) holds every column of the row but the prompt's (and the
    image column's), for reward functions that take data columns by name (TRL, verl). ``images`` (an attribute)
    holds the row's images as PNG data URLs, in the order of their tokens in ``prompt_tokens``; ``[]`` for text.
    """

    columns: dict[str, Any]
    images: list[str]

    def __new__(cls, data_index: int, prompt: Any, label: Any, metadata: dict[str, Any],
                prompt_tokens: list[int], columns: Mapping[str, Any] | None = None,
                images: Sequence[str] | None = None) -> PromptRow:
        row = super().__new__(cls, data_index, prompt, label, metadata, prompt_tokens)
        row.columns = dict(columns or {})
        row.images = list(images or [])
        return row

    def _replace(self, **changes: Any) -> PromptRow:
        images = changes.pop("images", self.images)
        return PromptRow(*super()._replace(**changes), columns=self.columns, images=images)


def _data_format(url: str, fmt: str | None) -> str:
    if fmt and fmt != "auto":
        if fmt not in ("jsonl", "parquet"):
            raise ConfigError(f"format={fmt!r}: unknown dataset format; use 'jsonl' or 'parquet'")
        return fmt
    lowered = url.lower()
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    raise ConfigError(
        f"prompt_data={url!r}: cannot tell the format from the name; name it *.jsonl or *.parquet "
        "or set the dataset format explicitly"
    )


def read_rows(url: str, fmt: str | None = None) -> list[dict[str, Any]]:
    """Read every row of a jsonl or parquet file at ``url`` (a path or any fsspec URL).

    A line that is not a JSON object raises :class:`ConfigError` naming the file and the row.
    """
    import fsspec

    kind = _data_format(url, fmt)
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            with fsspec.open(url, "rb") as fh:
                return pq.read_table(fh).to_pylist()
        rows: list[dict[str, Any]] = []
        with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as fh:
            for line_no, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"prompt data {url!r} line {line_no} (row {len(rows)}): not valid JSON ({e.msg}); "
                        "each line must be one JSON object"
                    ) from None
                if not isinstance(row, dict):
                    raise ConfigError(
                        f"prompt data {url!r} line {line_no} (row {len(rows)}): expected a JSON object, "
                        f"got {type(row).__name__}"
                    )
                rows.append(row)
        return rows
    except FileNotFoundError:
        raise ConfigError(f"prompt_data={url!r}: file not found; check the path or URL") from None


def resolve_data_url(url: str, cache_dir: str | None = None, seed: int = 0) -> str:
    """Map generated datasets to a materialised local file: ``builtin:`` tasks, ``reasoning-gym:<task>``
    (:mod:`raygym.envs.reasoning_gym_tasks`) and a verifiers environment's dataset (``verifiers:<env>``,
    :mod:`raygym.envs.verifiers_env`); other URLs pass through."""
    from raygym.builtin import is_builtin, materialize_dataset
    from raygym.envs.reasoning_gym_tasks import is_task_uri, materialize_task
    from raygym.envs.specs import parse_env_spec

    directory = cache_dir or str(Path(tempfile.gettempdir()) / "raygym-data")
    if is_builtin(url):
        return materialize_dataset(url, directory, seed=seed)
    if is_task_uri(url):
        return materialize_task(url, directory)
    spec = parse_env_spec(url, "prompt_data")
    if spec is not None and spec.scheme == "verifiers":
        from raygym.envs.verifiers_env import materialize_environment_data

        return materialize_environment_data(spec, url, directory)
    if spec is not None:
        raise ConfigError(f"prompt_data={url!r}: an OpenEnv environment is no dataset; pass it as --rollout-env "
                          "and give --prompt-data rows (a prompt and, e.g., metadata.seed per episode)")
    return url


def render_prompt(
    prompt: Any, tokenizer: Any, apply_chat_template: bool, chat_template_kwargs: Mapping[str, Any] | None
) -> str:
    """The text sent to the model: the chat template applied (with the generation prompt) or the raw text."""
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
    if not isinstance(prompt, str):
        raise ValueError("holds chat messages, not text; set apply_chat_template=True to template them")
    return prompt


def parse_chat_template_kwargs(value: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """``apply_chat_template_kwargs`` as a dict: accepts a dict, a JSON string or ``""``/None."""
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"apply_chat_template_kwargs={value!r}: must be a JSON object such as "
            '\'{"enable_thinking": false}\''
        )
    return parsed


class PromptDataset:
    """Tokenized prompts with a resumable, seeded per-epoch order.

    Build it with :meth:`from_url` (or :func:`dataset_from_config`). ``next_batch(n)`` walks the
    current epoch's order and rolls over into the next epoch (a fresh permutation when
    ``shuffle``) as needed; ``state_dict()`` / ``load_state_dict()`` save and restore the position.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        source: str = "<rows>",
        input_key: str = "prompt",
        label_key: str | None = "label",
        metadata_key: str | None = "metadata",
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: Mapping[str, Any] | str | None = None,
        max_prompt_len: int | None = None,
        prompt_len_policy: str = "filter",
        shuffle: bool = True,
        seed: int = 1234,
        image_key: str | None = None,
        image_processor: Any = None,
        data_dir: str | None = None,
    ) -> None:
        if prompt_len_policy not in PROMPT_LEN_POLICIES:
            raise ConfigError(
                f"prompt_len_policy={prompt_len_policy!r}: unknown policy; use one of {PROMPT_LEN_POLICIES}"
            )
        if max_prompt_len is not None and max_prompt_len <= 0:
            raise ConfigError(f"rollout_max_prompt_len={max_prompt_len}: must be a positive int or None")
        self.source = source
        self.shuffle = shuffle
        self.seed = seed
        kwargs = parse_chat_template_kwargs(apply_chat_template_kwargs)
        self.num_filtered = 0  # rows dropped by the "filter" prompt-length policy
        self.num_bad_images = 0  # rows skipped: an image that could not be used when the data loaded
        self.bad_image_reasons: list[str] = []  # the first BAD_IMAGE_REASONS_KEPT of their reasons
        self.num_image_cuts = 0  # rows dropped by "truncate": the cut would split an image
        self._images = None
        if image_key:
            from raygym.vision.dataset import ImagePrompts, load_image_processor

            if isinstance(image_processor, str):  # a model path: builtin names and remote URLs resolved first
                from raygym.builtin import resolve_model_path

                image_processor = load_image_processor(resolve_model_path(image_processor), image_processor)
            self._images = ImagePrompts(image_key, tokenizer, image_processor, data_dir)
        self._items: list[PromptRow] = []
        for index, row in enumerate(rows):
            built = self._build_item(index, row, tokenizer, input_key, label_key, metadata_key,
                                     apply_chat_template, kwargs)
            if built is None:
                continue
            item, image_prompt = built
            if max_prompt_len is not None and len(item.prompt_tokens) > max_prompt_len:
                if prompt_len_policy == "filter":
                    self.num_filtered += 1
                    continue
                item = self._truncate(item, image_prompt, max_prompt_len)
                if item is None:
                    continue
            self._items.append(item)
        if self.num_bad_images:
            import logging

            logging.getLogger(__name__).warning(
                "prompt data %r: %d row(s) skipped for images that could not be used, e.g. %s", source,
                self.num_bad_images, "; ".join(self.bad_image_reasons))
        if not self._items:
            images = (f", {self.num_bad_images} with unusable images, {self.num_image_cuts} whose truncation would "
                      "cut an image") if image_key else ""
            raise ConfigError(
                f"prompt data {source!r}: no usable rows ({len(rows)} read, {self.num_filtered} longer than "
                f"rollout_max_prompt_len={max_prompt_len}{images}); raise rollout_max_prompt_len or check the file"
                + (f" (first image problem: {self.bad_image_reasons[0]})" if self.bad_image_reasons else "")
            )
        self._epoch = 0
        self._offset = 0
        self._order = self._epoch_order(0)

    def _build_item(self, index, row, tokenizer, input_key, label_key, metadata_key, use_template, kwargs):
        where = f"prompt data {self.source!r} row {index}"
        if not isinstance(row, Mapping):
            raise ConfigError(f"{where}: expected an object with key {input_key!r}, got {type(row).__name__}")
        if input_key not in row:
            raise ConfigError(
                f"{where}: missing input_key {input_key!r} (keys: {sorted(row)}); set input_key to the prompt column"
            )
        if label_key and label_key not in row:
            raise ConfigError(
                f"{where}: missing label_key {label_key!r} (keys: {sorted(row)}); set label_key to the "
                "answer column, or None for unlabelled data"
            )
        metadata = row.get(metadata_key) if metadata_key else None
        if metadata is None:
            metadata = {}
        if isinstance(metadata, str):  # parquet columns often hold JSON text
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                metadata = None
        if not isinstance(metadata, dict):
            raise ConfigError(f"{where}: metadata_key {metadata_key!r} must hold an object (or JSON text of one)")
        prompt = row[input_key]

        def render(value: Any) -> str:
            try:
                return render_prompt(value, tokenizer, use_template, kwargs)
            except ValueError as e:
                raise ConfigError(f"{where}: input_key {input_key!r} {e}") from None

        label = row[label_key] if label_key else None
        if self._images is None:
            tokens = list(tokenizer.encode(render(prompt), add_special_tokens=False))
            columns = {k: v for k, v in row.items() if k != input_key}
            return PromptRow(index, prompt, label, metadata, tokens, columns), None
        from raygym.vision.images import ImageError

        try:
            images = self._images.load(row, where)
        except ImageError as e:
            self.num_bad_images += 1
            if len(self.bad_image_reasons) < BAD_IMAGE_REASONS_KEPT:
                self.bad_image_reasons.append(str(e))
            return None
        built = self._images.build(prompt, images, render, tokenizer, where)
        columns = {k: v for k, v in row.items() if k not in (input_key, self._images.column)}
        return PromptRow(index, prompt, label, metadata, built.tokens, columns, built.images), built

    def _truncate(self, item: PromptRow, image_prompt: ImagePrompt | None, max_len: int) -> PromptRow | None:
        """``item`` keeping its last ``max_len`` prompt tokens; None (counted) when that would split an image."""
        if image_prompt is None or not image_prompt.images:
            return item._replace(prompt_tokens=item.prompt_tokens[-max_len:])
        from raygym.vision.dataset import truncate_image_tokens

        kept = truncate_image_tokens(item.prompt_tokens, image_prompt.image_token, image_prompt.sizes, max_len)
        if kept is None:
            self.num_image_cuts += 1
            return None
        tokens, dropped = kept
        return item._replace(prompt_tokens=tokens, images=item.images[dropped:])

    @classmethod
    def from_url(
        cls, url: str, tokenizer: Any, *, fmt: str | None = None, cache_dir: str | None = None, **kwargs: Any
    ) -> PromptDataset:
        """Load ``url`` (path, ``file://``, ``memory://``, any fsspec URL, or ``builtin:next-digit``); relative
        image paths are relative to the file's directory."""
        local = resolve_data_url(url, cache_dir)
        if kwargs.get("image_key") and kwargs.get("data_dir") is None:
            from raygym.vision.dataset import data_dir

            kwargs["data_dir"] = data_dir(local)
        return cls(read_rows(local, fmt), tokenizer, source=url, **kwargs)

    def load_metrics(self) -> dict[str, float]:
        """What loading left out, as run metrics (the training loop logs them with its first step):
        ``data/num_bad_images``, rows skipped for images that could not be used (e.g. a remote file's, which the
        up-front data check does not read), and ``data/num_image_cuts``, rows the "truncate" policy dropped rather
        than split an image. ``{}`` for a dataset without an image column."""
        if self._images is None:
            return {}
        return {"data/num_bad_images": float(self.num_bad_images), "data/num_image_cuts": float(self.num_image_cuts)}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, position: int) -> PromptRow:
        return self._items[position]

    @property
    def epoch(self) -> int:
        return self._epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._items)))
        if self.shuffle:
            # Depends only on (seed, epoch): a resumed run reproduces the same order.
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next ``n`` prompts, rolling over into later epochs (n may exceed the dataset size)."""
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        out: list[PromptRow] = []
        while len(out) < n:
            if self._offset >= len(self._order):
                self._epoch += 1
                self._offset = 0
                self._order = self._epoch_order(self._epoch)
            take = min(n - len(out), len(self._order) - self._offset)
            out.extend(self._items[i] for i in self._order[self._offset : self._offset + take])
            self._offset += take
        return out

    @property
    def position(self) -> int:
        """How many prompts :meth:`next_batch` handed out so far, over every epoch (a prompt's place in the
        run's endless prompt stream; :meth:`row_at` finds it again)."""
        return self._epoch * len(self._items) + self._offset

    def row_at(self, position: int) -> PromptRow:
        """The prompt :meth:`next_batch` hands out at stream ``position`` (any epoch; the order depends only on
        the seed and the epoch)."""
        epoch, offset = divmod(position, len(self._items))
        order = self._order if epoch == self._epoch else self._epoch_order(epoch)
        return self._items[order[offset]]

    def state_dict(self) -> dict[str, Any]:
        """The data position, JSON-serialisable: ``{"epoch", "offset", "seed", "size", "shuffle"}``."""
        return {"epoch": self._epoch, "offset": self._offset, "seed": self.seed, "size": len(self._items),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (the dataset must have the same size)."""
        if int(state.get("size", len(self._items))) != len(self._items):
            raise ConfigError(
                f"prompt data {self.source!r}: the checkpoint's data position is for {state['size']} rows but "
                f"the dataset has {len(self._items)}; resume with the same prompt_data and rollout_max_prompt_len"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self._items):
            raise ConfigError(f"data position epoch={epoch} offset={offset}: out of range for {self.source!r}")
        self._epoch, self._offset = epoch, offset
        self._order = self._epoch_order(epoch)


def dataset_options(cfg: TrainConfig) -> dict[str, Any]:
    """PromptDataset keyword arguments from a ``TrainConfig`` (dataset + recipe fields). With an image column in
    ``multimodal_keys``, ``image_key`` names it and ``image_processor`` is the model path its processor loads
    from (``hf_checkpoint``, which the driver has resolved to a local directory by the time the data loads)."""
    from raygym.vision.dataset import image_column

    ds, recipe = cfg.dataset, cfg.recipe
    image_key = image_column(recipe.multimodal_keys)
    return {
        "image_key": image_key,
        "image_processor": cfg.model.hf_checkpoint if image_key else None,
        "input_key": ds.input_key,
        "label_key": ds.label_key,
        "metadata_key": ds.metadata_key,
        "apply_chat_template": ds.apply_chat_template,
        "apply_chat_template_kwargs": cfg.chat_template_kwargs(),
        "max_prompt_len": recipe.rollout_max_prompt_len,
        "shuffle": recipe.rollout_shuffle,
        "seed": recipe.seed,
    }


def dataset_from_config(cfg: TrainConfig, tokenizer: Any, cache_dir: str | None = None) -> PromptDataset:
    """The training prompt dataset of a ``TrainConfig`` (``cfg.dataset.prompt_data``)."""
    return PromptDataset.from_url(cfg.dataset.prompt_data, tokenizer, fmt=cfg.dataset.format, cache_dir=cache_dir,
                                  **dataset_options(cfg))


def eval_dataset_urls(cfg: TrainConfig) -> dict[str, str]:
    """name -> URL of the eval datasets: ``cfg.dataset.eval_prompt_data`` plus ``recipe.eval_config["datasets"]``
    (a list of ``{"name", "path"}``); when neither names one and the run trains on a builtin task, that task's
    held-out split (``builtin:<task>#eval``)."""
    from raygym.builtin import default_eval_data

    urls = dict(cfg.dataset.eval_prompt_data)
    eval_config = cfg.recipe.eval_config or {}
    for entry in eval_config.get("datasets", []):
        if not isinstance(entry, Mapping) or "name" not in entry or "path" not in entry:
            raise ConfigError(f"eval_config datasets entry {entry!r}: needs 'name' and 'path'")
        urls[str(entry["name"])] = str(entry["path"])
    return urls or default_eval_data(cfg.dataset.prompt_data)


def load_eval_datasets(
    urls: Mapping[str, str], tokenizer: Any, cache_dir: str | None = None, **options: Any
) -> dict[str, PromptDataset]:
    """Eval datasets (name -> URL) loaded like the training data, in file order (never shuffled)."""
    options = {**options, "shuffle": False}
    return {name: PromptDataset.from_url(url, tokenizer, cache_dir=cache_dir, **options) for name, url in urls.items()}
