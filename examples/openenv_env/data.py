"""Prompt rows for examples/openenv_env: ``python -m examples.openenv_env.data --out DIR`` writes ``train.jsonl``
and ``eval.jsonl``. A row only starts an episode: the prompt ``count up\\n`` and ``metadata.seed``, which the
environment's ``reset(seed)`` turns into the first question."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": "count up\n", "label": None, "metadata": {"seed": rng.randrange(10_000)}} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.openenv_env.data")
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(args.size, 0)))
    (out / "eval.jsonl").write_text("".join(json.dumps({"prompt": "count up\n", "label": None,
                                                         "metadata": {"seed": d}}) + "\n" for d in range(10)))
    print(f"wrote {out}/train.jsonl ({args.size} rows) and {out}/eval.jsonl (10 rows)")


if __name__ == "__main__":
    main()
