"""`raygym train` with bad data or a bad reward stops before Ray starts: exit code 2 within seconds
and one stderr line naming the file, the line, the key and the fix (the real command, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GSM8K = REPO_ROOT / "tests" / "fixtures" / "gsm8k_sample.jsonl"
LIMIT_S = 20  # the bound a user should wait for a typo, with Python start-up included


def train(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}", "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "raygym", "train", "--output-dir", str(tmp_path / "run"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


def assert_stopped_early(done: subprocess.CompletedProcess, elapsed: float, *needles: str) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert elapsed < LIMIT_S, f"took {elapsed:.1f}s"
    err = done.stderr
    assert err.startswith("raygym: error: ") and err.count("\n") == 1, err  # one line, no traceback
    assert "\x1b[" not in err
    assert "Ray" not in done.stdout and "Started a local Ray instance" not in err  # nothing was started
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def gsm8k_flags(path: Path | str) -> list[str]:
    return ["--prompt-data", str(path), "--input-key", "question", "--label-key", "answer", "--rm-type", "gsm8k"]


def test_missing_prompt_data_file(tmp_path):
    done, elapsed = train(tmp_path, *gsm8k_flags("nowhere/gsm8k.jsonl"))
    assert_stopped_early(done, elapsed, "prompt_data='nowhere/gsm8k.jsonl'", "no such file",
                         str(tmp_path / "nowhere" / "gsm8k.jsonl"), "--prompt-data")


def test_broken_json_line_is_named(tmp_path):
    lines = GSM8K.read_text().splitlines()
    lines[3] = lines[3][:-1]  # drop the closing brace of the 4th row
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    done, elapsed = train(tmp_path, *gsm8k_flags("broken.jsonl"))
    assert_stopped_early(done, elapsed, "prompt_data='broken.jsonl' line 4", "not valid JSON", "fix or delete line 4")


def test_wrong_input_key_names_the_columns_and_the_fix(tmp_path):
    done, elapsed = train(tmp_path, "--prompt-data", str(GSM8K), "--label-key", "answer", "--rm-type", "gsm8k")
    assert_stopped_early(done, elapsed, "line 1", "no key 'prompt' for --input-key", "answer, question",
                         "pass --input-key question")


def test_wrong_label_key_on_a_later_line(tmp_path):
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    rows[4]["solution"] = rows[4].pop("answer")
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done, elapsed = train(tmp_path, *gsm8k_flags("mixed.jsonl"))
    assert_stopped_early(done, elapsed, "mixed.jsonl' line 5", "no key 'answer' for --label-key",
                         "pass --label-key solution", "--no-label-key")


def test_own_data_with_the_builtin_task_reward_names_rm_type_and_its_choices(tmp_path):
    done, elapsed = train(tmp_path, "--prompt-data", str(GSM8K), "--input-key", "question", "--label-key", "answer")
    err = assert_stopped_early(done, elapsed, "rm_type='next_digit'", "--rm-type")
    for choice in ("'math'", "'math_verify'", "'gsm8k'", "'exact'"):
        assert choice in err


def test_unknown_rm_type_lists_the_choices(tmp_path):
    done, elapsed = train(tmp_path, *gsm8k_flags(GSM8K)[:-1], "gsm8")
    assert_stopped_early(done, elapsed, "rm_type='gsm8'", "--rm-type", "'gsm8k'", "'math_verify'")


def test_unwritable_save_directory(tmp_path):
    (tmp_path / "a-file").write_text("")
    done, elapsed = train(tmp_path, *gsm8k_flags(GSM8K), "--save", str(tmp_path / "a-file" / "ckpt"))
    assert_stopped_early(done, elapsed, "save=", "cannot write there", "--save ''")


@pytest.mark.parametrize(
    ("source", "needles"),
    [
        ("def score(a, b, c):\n    return 0.0\n", ["unsupported signature", "score(a, b, c)", "completions"]),
        ("def score(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n",
         ["'solution'", "no such column", "answer, question"]),
    ],
    ids=["unusable-signature", "trl-column-missing"],
)
def test_reward_function_problems_are_found_at_start_up(tmp_path, source, needles):
    (tmp_path / "my_rewards.py").write_text(source)
    flags = gsm8k_flags(GSM8K)[:-2] + ["--custom-rm-function", "my_rewards:score"]
    done, elapsed = train(tmp_path, *flags)
    assert_stopped_early(done, elapsed, *needles)
