"""Write the haiku example's prompts: ``haiku about <topic>:`` (the tiny model's alphabet: lowercase).

    python -m examples.haiku_judge.make_data --out runs/examples/haiku-data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOPICS = ("the sea", "rain", "snow", "the moon", "a cat", "spring", "an old pond", "the wind", "autumn",
          "a frog", "cherry trees", "the night", "a river", "the sun", "winter", "a bird")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"haiku about {topic}:\n", "label": None, "metadata": {"topic": topic}} for topic in TOPICS]
    for name, part in (("train", rows[:12]), ("eval", rows[12:])):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path} ({len(part)} prompts)")


if __name__ == "__main__":
    main()
