"""Write the code example's tasks: infer a one-line function from examples, judged by hidden tests.

Each prompt shows f on 0, 1 and 2 and ends with ``f=lambda x:``; the model writes the body. The label
holds the tests: for the three shown inputs and two hidden, larger ones (20, 50: no constant is close to all), ``|f(x) - expected|`` within 0, 1, 3 and 6
(graded, so the fraction passed is also a measure of how close the function is). The tiny model's alphabet has no brackets or
underscores, so the functions are ``x+k`` (the default set), ``x*k`` and ``k``.

    python -m examples.code_sandbox.make_data --out runs/examples/code-data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOLERANCES = (0, 1, 3, 6)


def task(kind: str, k: int) -> dict:
    fn = {"add": lambda x: x + k, "mul": lambda x: x * k, "const": lambda x: k}[kind]
    shown = " ".join(f"{x}={fn(x)}" for x in (0, 1, 2))
    # Graded: per input, |f(x) - expected| within 0, 1, 3 and 6, so a near miss earns part of the reward.
    tests = [f"assert abs(f({x}) - {fn(x)}) <= {tol}" for x in (0, 1, 2, 20, 50) for tol in TOLERANCES]
    return {"prompt": f"f {shown}\nf=lambda x:", "label": tests, "metadata": {"kind": kind, "k": k}}


def all_tasks(kinds: tuple[str, ...] = ("add",)) -> list[dict]:
    """Every task of ``kinds``: ``add`` (x+k, k = 0..9), ``mul`` (x*k, k = 2..5), ``const`` (k, k = 0..9)."""
    ranges = {"add": range(10), "mul": range(2, 6), "const": range(10)}
    return [task(kind, k) for kind in kinds for k in ranges[kind]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--eval", type=int, default=2, help="tasks held out for eval")
    parser.add_argument("--kinds", default="add", help="comma-separated: add, mul, const")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = all_tasks(tuple(k.strip() for k in args.kinds.split(",") if k.strip()))
    random.Random(args.seed).shuffle(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[args.eval:]), ("eval", rows[: args.eval])):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path} ({len(part)} tasks)")


if __name__ == "__main__":
    main()
