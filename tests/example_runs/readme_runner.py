"""Run an example's README commands as a user would, shortened for CI.

The commands are the ``raygym ...`` and ``python -m ...`` lines of the first ```bash block of ``examples/<name>/README.md``;
paths under ``runs/examples/`` are moved into the test's temp directory (the run TOML is copied with the
same change) and ``raygym train`` gets ``--num-rollout``/extra flags appended.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def readme_commands(name: str) -> list[str]:
    """The ``raygym`` / ``python -m`` command lines of the example's first bash block."""
    text = (REPO_ROOT / "examples" / name / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, f"examples/{name}/README.md has no ```bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip().startswith(("raygym ", "python -m "))]


def run_example(name: str, tmp: Path, *, train_flags: list[str], timeout: float = 540) -> list[dict[str, Any]]:
    """Run the README's commands (moved into ``tmp``); returns the metrics rows of the last training run."""
    moved = str(tmp) + "/"
    ray_tmp = tempfile.mkdtemp(prefix="rgx-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)
    out_dir = None
    try:
        for line in readme_commands(name):
            words = shlex.split(line.replace("runs/examples/", moved))
            args = words[1:] if words[0] == "raygym" else words[2:]
            module = "raygym" if words[0] == "raygym" else words[2]
            for i, arg in enumerate(args):
                if arg.endswith(".toml"):
                    copy = tmp / Path(arg).name
                    copy.write_text((REPO_ROOT / arg).read_text().replace("runs/examples/", moved))
                    args[i] = str(copy)
            if module == "raygym" and args[0] == "train":
                if "--output-dir" in args:
                    out_dir = Path(args[args.index("--output-dir") + 1])
                    args += train_flags
                else:
                    out_dir = tmp / f"run-{name}"
                    args += [*train_flags, "--output-dir", str(out_dir)]
            argv = [sys.executable, "-m", "raygym", *args] if module == "raygym" else [sys.executable, "-m", *args]
            done = subprocess.run(argv, cwd=REPO_ROOT, env=env,
                                  capture_output=True, text=True, timeout=timeout)
            assert done.returncode == 0, f"{line}\n{(done.stdout + done.stderr)[-4000:]}"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out_dir is not None, f"examples/{name}/README.md has no 'raygym train' command"
    return [json.loads(row) for row in (out_dir / "metrics.jsonl").read_text().splitlines()]
