"""Things raygym ships so that a run needs no download: a tiny Qwen3 model with a character
tokenizer, and a synthetic, verifiable task.

URIs: ``builtin:tiny-qwen3`` and ``builtin:tiny-qwen3-moe`` (models), ``builtin:next-digit`` and ``builtin:long-tail`` (datasets, each
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

from raygym.builtin.chars import CHARS as CHARS
from raygym.builtin.chars import CHAT_TEMPLATE as CHAT_TEMPLATE
from raygym.builtin.chars import EOS as EOS
from raygym.builtin.chars import PAD as PAD
from raygym.builtin.chars import build_tokenizer as build_tokenizer
from raygym.builtin.files import write_model_dir

BUILTIN_PREFIX = "builtin:"
TINY_MODEL = "builtin:tiny-qwen3"
TINY_MOE_MODEL = "builtin:tiny-qwen3-moe"
NEXT_DIGIT_TASK = "builtin:next-digit"
NEXT_DIGIT_ROWS = 1024  # rows of a materialised builtin dataset
# Repeat rows, "rep:7x3=" -> "777": one row in LONG_EVERY asks for LONG_REPEATS copies ("long:7x45="), the
# others for SHORT_REPEATS, so a model that learns the task keeps a heavy tail of response lengths (the case
# asynchronous training is for). The verb says which kind a row is: with the count alone to go by, the tiny
# model did not tell the kinds apart within 100 steps (it stopped early, or ran on, everywhere).
LONG_TAIL_TASK = "builtin:long-tail"
LONG_EVERY = 8
SHORT_REPEATS = (1, 3)
LONG_REPEATS = (32, 56)
# The builtin datasets and the built-in reward (rm_type) that scores each.
COUNT_SHAPES_TASK = "builtin:count-shapes"  # a visual task (raygym/builtin/count_shapes.py)
BUILTIN_TASKS = {NEXT_DIGIT_TASK: "next_digit", LONG_TAIL_TASK: "long_tail", COUNT_SHAPES_TASK: "count_shapes"}

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

# The MoE sibling: Qwen3-MoE with 8 experts, top-2, every layer sparse. head_dim 32 so that vLLM's CPU attention
# (head sizes >= 32) runs it as it is; the other widths are the dense model's.
TINY_MOE_ARCH: dict[str, Any] = {
    **TINY_ARCH,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
}
TINY_VLM_MODEL = "builtin:tiny-qwen2.5-vl"  # raygym/builtin/tiny_vlm.py
BUILTIN_MODELS = {TINY_MODEL: "tiny-qwen3", TINY_MOE_MODEL: "tiny-qwen3-moe", TINY_VLM_MODEL: "tiny-qwen2.5-vl"}


def is_builtin(uri: str | None) -> bool:
    return bool(uri) and str(uri).startswith(BUILTIN_PREFIX)


def build_tiny_model(seed: int = 0, uri: str = TINY_MODEL, **overrides: Any):
    """A randomly initialised Qwen3ForCausalLM of about 0.1M parameters (deterministic in ``seed``), or with
    ``uri=TINY_MOE_MODEL`` its Qwen3MoeForCausalLM sibling."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer()
    moe = uri == TINY_MOE_MODEL
    arch = {"vocab_size": len(tok), "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1, "torch_dtype": "float32",
            **(TINY_MOE_ARCH if moe else TINY_ARCH), **overrides}  # torch_dtype: transformers 4.x's name
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**arch)) if moe else Qwen3ForCausalLM(Qwen3Config(**arch))
    return model, tok


def materialize_model(uri: str, directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Write the builtin model ``uri`` under ``directory`` (once) and return its local path."""
    if uri not in BUILTIN_MODELS:
        from raygym.errors import ConfigError

        raise ConfigError(f"hf_checkpoint={uri!r}: unknown builtin model; the builtin models are "
                          f"{', '.join(map(repr, BUILTIN_MODELS))}")
    if uri == TINY_VLM_MODEL:
        from raygym.builtin.tiny_vlm import materialize_vlm

        if overrides:
            raise ValueError(f"{uri}: takes no architecture overrides (got {sorted(overrides)})")
        return materialize_vlm(directory, seed)
    suffix = "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())) if overrides else ""
    path = Path(directory) / f"{BUILTIN_MODELS[uri]}-seed{seed}{suffix}"  # one directory per architecture
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return str(path)
    model, tok = build_tiny_model(seed, uri, **overrides)
    return write_model_dir(path, model, [tok.save_pretrained])


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
    """Rows of the ``long-tail`` task: prompt ``"rep:<d>x<k>="`` with ``k`` in ``SHORT_REPEATS`` (1-3), or on
    ``n // LONG_EVERY`` rows at seeded positions ``"long:<d>x<k>="`` with ``k`` in ``LONG_REPEATS`` (32-56);
    the label is the digit ``d`` ``k`` times.

    >>> long_tail_rows(16, seed=0)[:2]
    [{'prompt': 'rep:6x1=', 'label': '6'}, {'prompt': 'rep:4x3=', 'label': '444'}]
    >>> [(r["prompt"], len(r["label"])) for r in long_tail_rows(16, seed=0) if r["prompt"].startswith("long:")]
    [('long:1x53=', 53), ('long:5x45=', 45)]
    """
    rng = random.Random(seed)
    long_rows = set(rng.sample(range(n), n // LONG_EVERY))
    rows = []
    for i in range(n):
        digit = rng.randrange(10)
        verb, repeats = ("long", LONG_REPEATS) if i in long_rows else ("rep", SHORT_REPEATS)
        count = rng.randint(*repeats)
        rows.append({"prompt": f"{verb}:{digit}x{count}=", "label": str(digit) * count})
    return rows


def long_tail_reward(response: str, label: str) -> float:
    """The ``long-tail`` task's reward, shaped so that a random model gets signal on every row: for the
    stripped response, 0.25 x its leading run of digits and 0.25 x its leading run of the label's digit (each
    as a share of the label, capped at 1), plus 0.5 x its length score (1 at the label's length, falling
    linearly to 0 at no length or twice the length). Exactly right is 1.0.

    >>> long_tail_reward("777", "777"), long_tail_reward(" 7 ", "7"), long_tail_reward("7777", "777")
    (1.0, 1.0, 0.8333333333333334)
    >>> long_tail_reward("3", "7"), long_tail_reward("x", "7"), long_tail_reward("77", "7"), long_tail_reward("", "77")
    (0.75, 0.5, 0.5, 0.0)
    >>> long_tail_reward("4" * 30, "4" * 40), long_tail_reward("4" * 20 + "x" * 20, "4" * 40)
    (0.75, 0.75)
    """
    text = response.strip()
    want = max(len(label), 1)
    digits = len(text) - len(text.lstrip(string.digits))
    run = len(text) - len(text.lstrip(label[:1])) if label else 0
    length_score = max(0.0, 1.0 - abs(len(text) - want) / want)
    return 0.25 * min(digits, want) / want + 0.25 * min(run, want) / want + 0.5 * length_score


def count_shapes_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Rows of the ``count-shapes`` visual task (:mod:`raygym.builtin.count_shapes`)."""
    from raygym.builtin.count_shapes import count_shapes_rows as rows

    return rows(n, seed)


TASK_ROWS = {NEXT_DIGIT_TASK: next_digit_rows, LONG_TAIL_TASK: long_tail_rows, COUNT_SHAPES_TASK: count_shapes_rows}


def unknown_task(uri: str, field: str = "prompt_data") -> Exception:
    """The ConfigError for a ``builtin:`` dataset raygym does not ship."""
    from raygym.errors import ConfigError

    return ConfigError(f"{field}={uri!r}: unknown builtin dataset; use one of {', '.join(map(repr, BUILTIN_TASKS))}")


EVAL_SPLIT = "#eval"  # builtin:<task>#eval: the task's held-out eval split
EVAL_ROWS = 64
EVAL_SEED_OFFSET = 1_000_003  # the eval split's rows come from another seed than any training split's


def split_task(uri: str) -> tuple[str, bool]:
    """``(task URI, is the eval split)`` of a builtin dataset URI.

    >>> split_task("builtin:next-digit#eval"), split_task("builtin:long-tail")
    (('builtin:next-digit', True), ('builtin:long-tail', False))
    """
    task, sep, split = uri.partition("#")
    if sep and split != EVAL_SPLIT[1:]:
        raise unknown_task(uri)
    return task, bool(sep)


def default_eval_data(prompt_data: str) -> dict[str, str]:
    """The eval datasets a run on ``prompt_data`` gets when it names none: a builtin task's held-out split
    (so ``raygym eval`` works on the run ``raygym train`` makes with no flags); nothing for other data.

    >>> default_eval_data("builtin:next-digit"), default_eval_data("data.jsonl")
    ({'next-digit': 'builtin:next-digit#eval'}, {})
    """
    if not is_builtin(prompt_data) or "#" in prompt_data:
        return {}
    return {prompt_data.removeprefix(BUILTIN_PREFIX): prompt_data + EVAL_SPLIT}


def materialize_dataset(uri: str, directory: str | os.PathLike, seed: int = 0, n: int = NEXT_DIGIT_ROWS) -> str:
    """Write the builtin dataset ``uri`` (a task, or its ``#eval`` split of :data:`EVAL_ROWS` rows drawn with
    another seed) as jsonl under ``directory`` and return its path."""
    task, held_out = split_task(uri)
    if task not in TASK_ROWS:
        raise unknown_task(uri)
    if held_out:
        n, seed = EVAL_ROWS, seed + EVAL_SEED_OFFSET
    name = task.removeprefix(BUILTIN_PREFIX) + ("-eval" if held_out else "")
    path = Path(directory) / f"{name}-seed{seed}-n{n}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in TASK_ROWS[task](n, seed)))
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
