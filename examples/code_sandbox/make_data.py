"""Write the code example's tasks: infer a one-line function from examples, judged by hidden tests.

Each prompt shows f on 0, 1 and 2 and ends with ``f=lambda x:``; the model writes the body. The label
holds the tests (the three shown and two hidden inputs). The tiny model's alphabet has no brackets or
underscores, so the functions are ``x+k``, ``x*k`` and ``k``.

    python -m examples.code_sandbox.make_data --out runs/examples/code-data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def task(kind: str, k: int) -> dict:
    fn = {"add": lambda x: x + k, "mul": lambda x: x * k, "const": lambda x: k}[kind]
    shown = " ".join(f"{x}={fn(x)}" for x in (0, 1, 2))
    tests = [f"assert f({x}) == {fn(x)}" for x in (0, 1, 2, 5, 9)]
    return {"prompt": f"f {shown}\nf=lambda x:", "label": tests, "metadata": {"kind": kind, "k": k}}


def all_tasks() -> list[dict]:
    return ([task("add", k) for k in range(1, 10)] + [task("mul", k) for k in range(2, 6)]
            + [task("const", k) for k in range(10)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--eval", type=int, default=4, help="tasks held out for eval")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = all_tasks()
    random.Random(args.seed).shuffle(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[args.eval:]), ("eval", rows[: args.eval])):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path} ({len(part)} tasks)")


if __name__ == "__main__":
    main()
