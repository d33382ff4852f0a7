"""Things raygym ships so that a run needs no download: a tiny Qwen3 model with a character
tokenizer, and a synthetic, verifiable task.

URIs: ``builtin:tiny-qwen3`` (model), ``builtin:next-digit`` and ``builtin:long-tail`` (datasets, each
with its reward: :data:`BUILTIN_TASKS`). They are materialised into a local directory on first use; the same
seed always gives the same files.

>>> import tempfile
>>> path = materialize_model("builtin:tiny-qwen3", tempfile.mkdtemp())
>>> from transformers import AutoTokenizer
>>> AutoTokenizer.from_pretrained(path).decode(AutoTokenizer.from_pretrained(path).encode("next:7="))
'next:7='

"""

from __future__ import annotations

import json
import os
import random
import string
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
TINY_MODEL = "builtin:tiny-qwen3"
NEXT_DIGIT_TASK = "builtin:next-digit"
NEXT_DIGIT_ROWS = 1024  # rows of a materialised builtin dataset
# Next-digit rows (one-token answers) and, one row in COPY_EVERY, a copy row (a 24-56 character answer): once
# a model learns it, response lengths have a heavy tail, the case asynchronous training is for.
LONG_TAIL_TASK = "builtin:long-tail"
COPY_EVERY = 8
COPY_CHARS = string.digits + string.ascii_lowercase
COPY_LENGTHS = (24, 56)
# The builtin datasets and the built-in reward (rm_type) that scores each.
BUILTIN_TASKS = {NEXT_DIGIT_TASK: "next_digit", LONG_TAIL_TASK: "long_tail"}

PAD, EOS = "<|pad|>", "<|eos|>"
# One token per character; small so a random model can learn the task in minutes.
CHARS = string.digits + string.ascii_lowercase + " +-*/=:?.,#\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)

TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def is_builtin(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(BUILTIN_PREFIX)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (pad=0, eos=1) built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=PAD, clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(seed: int = 0, **overrides: Any):
    """A randomly initialised Qwen3ForCausalLM of about 0.1M parameters (deterministic in ``seed``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer()
    arch = {**TINY_ARCH, **overrides}
    config = Qwen3Config(
        vocab_size=len(tok), pad_token_id=0, eos_token_id=1, bos_token_id=1, torch_dtype="float32", **arch
    )  # type: ignore[call-arg]  # torch_dtype: accepted at runtime (transformers 4.x name), absent from 5.x's signature
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model, tok


def materialize_model(uri: str, directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Write the builtin model ``uri`` under ``directory`` (once) and return its local path."""
    if uri != TINY_MODEL:
        from raygym.errors import ConfigError

        raise ConfigError(f"hf_checkpoint={uri!r}: unknown builtin model; the builtin model is {TINY_MODEL!r}")
    suffix = "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) if overrides else ""
    path = Path(directory) / f"tiny-qwen3-seed{seed}{suffix}"  # one directory per architecture
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return str(path)
    model, tok = build_tiny_model(seed, **overrides)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 0.3 MB write needs no progress bar in the run's output
    try:
        model.save_pretrained(tmp)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def next_digit_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Rows of the ``next-digit`` task: prompt ``"next:7="``, label ``"8"`` (successor mod 10)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randrange(10)
        rows.append({"prompt": f"next:{d}=", "label": str((d + 1) % 10)})
    return rows


def next_digit_reward(response: str, label: str) -> float:
    """Shaped so a random model gets signal: 0.25 for a digit first, 0.5 more if it is the right
    digit, 0.25 more for stopping right after it.

    >>> next_digit_reward("8", "8"), next_digit_reward("8x", "8"), next_digit_reward("3", "8"), next_digit_reward("x", "8")
    (1.0, 0.75, 0.5, 0.0)
    """
    text = response.strip()
    if not text or not text[0].isdigit():
        return 0.0
    reward = 0.25 + (0.5 if text[0] == label else 0.0)
    return reward + (0.25 if len(text) == 1 else 0.0)


def long_tail_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Rows of the ``long-tail`` task: ``n // COPY_EVERY`` copy rows (prompt ``"copy:k3x...="``, label the
    24-56 characters between ``:`` and ``=``) at seeded positions, next-digit rows elsewhere.

    >>> rows = long_tail_rows(16, seed=0)
    >>> sum(r["prompt"].startswith("copy:") for r in rows), all(r["prompt"] == f"copy:{r['label']}=" for r in rows
    ...                                                           if r["prompt"].startswith("copy:"))
    (2, True)
    """
    rng = random.Random(seed)
    copies = set(rng.sample(range(n), n // COPY_EVERY))
    rows = []
    for i in range(n):
        if i in copies:
            text = "".join(rng.choice(COPY_CHARS) for _ in range(rng.randint(*COPY_LENGTHS)))
            rows.append({"prompt": f"copy:{text}=", "label": text})
        else:
            d = rng.randrange(10)
            rows.append({"prompt": f"next:{d}=", "label": str((d + 1) % 10)})
    return rows


def copy_reward(response: str, label: str) -> float:
    """0.75 times the share of the label the stripped response starts with, 0.25 more for all of it and
    nothing else.

    >>> copy_reward("abcd", "abcd"), copy_reward("abxx", "abcd"), copy_reward("abcde", "abcd"), copy_reward("", "abcd")
    (1.0, 0.375, 0.75, 0.0)
    """
    text = response.strip()
    prefix = len(os.path.commonprefix([text, label]))
    return 0.75 * prefix / max(len(label), 1) + (0.25 if text == label else 0.0)


def long_tail_reward(response: str, label: str) -> float:
    """The ``long-tail`` task's reward: a one-character label is a next-digit row
    (:func:`next_digit_reward`), a longer one a copy row (:func:`copy_reward`).

    >>> long_tail_reward("8", "8"), long_tail_reward("k3x", "k3xq")
    (1.0, 0.5625)
    """
    return next_digit_reward(response, label) if len(label) == 1 else copy_reward(response, label)


TASK_ROWS = {NEXT_DIGIT_TASK: next_digit_rows, LONG_TAIL_TASK: long_tail_rows}


def unknown_task(uri: str, field: str = "prompt_data") -> Exception:
    """The ConfigError for a ``builtin:`` dataset raygym does not ship."""
    from raygym.errors import ConfigError

    return ConfigError(f"{field}={uri!r}: unknown builtin dataset; use one of {', '.join(map(repr, BUILTIN_TASKS))}")


def materialize_dataset(uri: str, directory: str | os.PathLike, seed: int = 0, n: int = NEXT_DIGIT_ROWS) -> str:
    """Write the builtin dataset ``uri`` as jsonl under ``directory`` and return its path."""
    if uri not in TASK_ROWS:
        raise unknown_task(uri)
    path = Path(directory) / f"{uri.removeprefix(BUILTIN_PREFIX)}-seed{seed}-n{n}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in TASK_ROWS[uri](n, seed)))
        os.replace(tmp, path)
    return str(path)


def default_cache_dir() -> str:
    """``$RAYGYM_CACHE`` or ``~/.cache/raygym``: where builtin and remote models are materialised."""
    return os.environ.get("RAYGYM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "raygym"))


def resolve_model_path(hf_checkpoint: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """A path transformers and the servers can load: builtin models are materialised, remote fsspec URLs
    (``s3://``, ``gs://``, ``memory://`` ...) copied once under ``cache_dir``, local paths and Hub ids pass
    through.

    >>> resolve_model_path("/models/Qwen3-4B")
    '/models/Qwen3-4B'
    """
    from raygym.errors import ConfigError

    if not hf_checkpoint:
        raise ConfigError("hf_checkpoint='': the run needs a model; set --hf-checkpoint (a path, URL or Hub id)")
    cache = Path(cache_dir) if cache_dir is not None else Path(default_cache_dir())
    if is_builtin(hf_checkpoint):
        return materialize_model(hf_checkpoint, cache / "models", seed=seed)
    if "://" in hf_checkpoint and not hf_checkpoint.startswith("file://"):
        import fsspec

        local = cache / "models" / hf_checkpoint.replace("://", "_").replace("/", "_")
        if not (local / "config.json").exists():
            fs, root = fsspec.core.url_to_fs(hf_checkpoint)
            if not fs.exists(root):
                raise ConfigError(f"hf_checkpoint={hf_checkpoint!r}: nothing at that URL; check the path")
            fs.get(root.rstrip("/") + "/", str(local) + "/", recursive=True)
        return str(local)
    return hf_checkpoint.removeprefix("file://")
