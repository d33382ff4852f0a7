"""A calculator tool on arithmetic word problems: the multi-turn example environment.

The prompt is a word problem ending in ``calc:``. A model turn that ends with ``=`` is a tool call: the
calculator reads the arithmetic expression (digits and ``+ - * /``) written right before the ``=``
(anything earlier in the turn is ignored) and answers with its value, then ``answer:``; a call with no
expression before ``=`` gets ``error`` (a tool error). Any other turn is the final answer (the number it
starts with) and ends the episode.

Reward (at most 1.0), so that a model that cannot add yet still has something to learn: 0.1 for the
first tool call that evaluates, 0.2 more if its value is the right answer; 0.7 for a final answer that
starts with the right number, or 0.1 for one that starts with another number after a tool call that
evaluated (so answering without the tool earns nothing unless it is right).

Data: ``python -m raygym.envs.calculator --out DIR`` writes ``train.jsonl`` and ``eval.jsonl``.

>>> env = CalculatorEnv(); env.reset("tom has 23 pens and gets 58 more. how many now?\\ncalc:", "81", {})
>>> step = env.step("so 23+58=")
>>> step.observation, round(step.reward, 2), step.tool_call, step.tool_error
('81\\nanswer:', 0.3, True, False)
>>> env.step("81").reward, env.step("81").done
(0.7, True)
"""

from __future__ import annotations

import argparse
import json
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

from raygym.envs.base import Environment, Step

_EXPRESSION = re.compile(r"\s*\d{1,12}(\s*[-+*/]\s*\d{1,12}){0,8}\s*")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TRAILING_EXPRESSION = re.compile(r"\d{1,12}(\s*[-+*/]\s*\d{1,12}){0,8}\s*$")
NAMES = ("tom", "ann", "sam", "lea", "max", "ivy")
THINGS = ("apple", "pen", "book", "coin", "card", "shell")


def evaluate(expression: str) -> str | None:
    """The value of ``expression`` (integers and ``+ - * /``, usual precedence) as text, or None when it
    is not such an expression or divides by zero.

    >>> evaluate("2+3*4"), evaluate("7/2"), evaluate("1/0"), evaluate("import os")
    ('14', '3.5', None, None)
    """
    if not _EXPRESSION.fullmatch(expression):
        return None
    terms = re.findall(r"\d+|[-+*/]", expression)
    # Precedence by hand: no eval of model output, even restricted.
    values: list[Fraction] = [Fraction(int(terms[0]))]
    ops: list[str] = []
    for op, number in zip(terms[1::2], terms[2::2], strict=True):
        value = Fraction(int(number))
        if op in "*/":
            if op == "/" and value == 0:
                return None
            values[-1] = values[-1] * value if op == "*" else values[-1] / value
        else:
            ops.append(op)
            values.append(value)
    total = values[0]
    for op, value in zip(ops, values[1:], strict=True):
        total = total + value if op == "+" else total - value
    if total.denominator == 1:
        return str(total.numerator)
    return f"{float(total):.4f}".rstrip("0")


class CalculatorEnv(Environment):
    """Word problem -> optional calculator calls (``expr=``) -> final answer."""

    turn_stop = ("=",)

    def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> None:
        self.answer = str(label).strip()
        self.rewarded_call = False

    def step(self, action: str) -> Step:
        text = action.strip()
        if text.endswith("="):
            found = _TRAILING_EXPRESSION.search(text[:-1])
            result = evaluate(found.group(0)) if found else None
            if result is None:
                return Step(observation="error\ncalc:", tool_call=True, tool_error=True)
            reward = 0.0
            if not self.rewarded_call:
                self.rewarded_call = True
                reward = 0.1 + (0.2 if result == self.answer else 0.0)
            return Step(observation=f"{result}\nanswer:", reward=reward, tool_call=True)
        found = _NUMBER.match(text)
        if found is None:
            return Step(done=True)
        if found.group(0) == self.answer:
            return Step(reward=0.7, done=True)
        return Step(reward=0.1 if self.rewarded_call else 0.0, done=True)  # format credit only after the tool


def word_problem(rng: random.Random) -> dict[str, Any]:
    """One problem row ``{"prompt", "label", "metadata"}`` (sum, difference or product)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        text, answer = f"{name} has {a} {thing}s and gets {b} more. how many now?", a + b
    elif kind == "sub":
        a = rng.randint(20, 99)
        b = rng.randint(1, a - 1)
        text, answer = f"{name} has {a} {thing}s and gives away {b}. how many left?", a - b
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 19)
        text, answer = f"{a} boxes hold {b} {thing}s each. how many in all?", a * b
    return {"prompt": f"{text}\ncalc:", "label": str(answer), "metadata": {"kind": kind}}


def write_dataset(out_dir: str | Path, train: int = 512, held_out: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """``train.jsonl`` and a disjoint ``eval.jsonl`` of word problems under ``out_dir``."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < train + held_out:
        row = word_problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows[:train], rows[train:]), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write calculator word problems as raygym prompt files.")
    parser.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_dataset(args.out, args.train, args.eval, args.seed):
        print(path)


if __name__ == "__main__":
    main()
