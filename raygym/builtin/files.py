"""Writing a builtin model directory once, whole: into a temporary sibling, then renamed into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_model_dir(path: Path, model: Any, savers: list[Callable[[Path], None]]) -> str:
    """``model.save_pretrained`` (without transformers' progress bar: a small write) and each of ``savers`` into a
    temporary sibling of ``path``, renamed to ``path``; when another process won the race, its copy is kept."""
    from transformers.utils import logging as hf_logging

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    for save in savers:
        save(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)
