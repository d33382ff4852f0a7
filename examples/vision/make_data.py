"""Write the vision example's held-out rows twice: as they are, and with the images shuffled among the rows.

The prompt is the same on every row, so a model that reads the image scores on the first file what it scored in
training and, on the second, what any model scores without the image: chance (the share of rows whose shuffled
image happens to hold the row's count, about one in four).

    python -m examples.vision.make_data --out runs/examples/vision-data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from raygym.builtin.count_shapes import IMAGE_COLUMN, count_shapes_rows

EVAL_SEED = 7_000_001  # rows no training split draws


def swapped(rows: list[dict], seed: int = 0) -> list[dict]:
    """``rows`` with their images in a seeded random order (labels kept), and each image's own count beside it
    (``image_count``)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [{**row, IMAGE_COLUMN: rows[j][IMAGE_COLUMN], "image_count": rows[j]["label"]}
            for row, j in zip(rows, order, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args(argv)
    rows = count_shapes_rows(args.rows, EVAL_SEED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("heldout", rows), ("swapped", swapped(rows))):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"wrote {out}/heldout.jsonl and {out}/swapped.jsonl ({len(rows)} rows each)")


if __name__ == "__main__":
    main()
