"""The docs' runnable commands, checked without running them, and the docs' links.

Every ```bash runnable block of README.md and docs/*.md is found (and nothing else), each of its lines is one
call of a known program whose subcommand exists and takes the flags given, and every relative link points at a
file that exists. tests/e2e/test_docs_runnable.py runs the commands.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from raygym.cli.main import _take_option, app
from raygym.run.config_loading import load_train_config
from tests.doc_blocks import (
    REPO_ROOT,
    Command,
    DocCommandError,
    block_commands,
    broken_links,
    doc_files,
    fenced_blocks,
    page_commands,
    runnable_blocks,
)

PAGE = """# A page

```bash runnable
raygym plan --preset qwen3-4b   # a comment
raygym train --num-rollout 3 \\
    --output-dir runs/x
```

```bash
raygym train --preset qwen3-4b
```

```
$ raygym plan
```

- a list item:

  ```bash runnable
  python -m raygym.train --num-rollout 2
  ```

    raygym serve runs/x
"""


def _commands(text: str, tmp_path: Path) -> list[Command]:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page_commands(page)


def check_raygym_command(command: Command) -> None:
    """Resolve the subcommand in the ``raygym`` click app and parse its arguments as the CLI would; ``plan`` and
    ``train`` flags are also resolved into a TrainConfig. Raises DocCommandError naming the command."""
    args = command.raygym_args
    ctx = click.Context(app, info_name="raygym")
    group: click.Command = app
    names: list[str] = []
    while isinstance(group, click.Group):
        if not args:
            raise DocCommandError(f"{command.where}: {command.text!r} names no raygym command")
        name, args = args[0], args[1:]
        found = group.get_command(ctx, name)
        if found is None:
            choices = ", ".join(sorted(group.list_commands(ctx)))
            raise DocCommandError(f"{command.where}: {command.text!r}: {' '.join(names + [name])!r} is not a "
                                  f"raygym command (commands: {choices})")
        names.append(name)
        group = found
    if any(a in ("--help", "-h") for a in args):
        return
    try:
        group.make_context(" ".join(names), list(args), parent=ctx)
        if names in (["plan"], ["train"]):
            load_train_config(_take_option(list(args), "--cluster")[0])
    except click.ClickException as exc:
        raise DocCommandError(f"{command.where}: {command.text!r}: {exc.format_message()}") from exc
    except ValueError as exc:  # ConfigError
        raise DocCommandError(f"{command.where}: {command.text!r}: {exc}") from exc


def check_command(command: Command) -> None:
    """Everything that can be checked of a runnable command without running it."""
    if command.program == "python -c":
        if len(command.words) != 3:
            raise DocCommandError(f"{command.where}: python -c takes one quoted program, got {command.words[2:]}")
        try:
            compile(command.words[2], command.where, "exec")
        except SyntaxError as exc:
            raise DocCommandError(f"{command.where}: the python -c program does not compile: {exc}") from exc
        return
    check_raygym_command(command)


# ── extraction ───────────────────────────────────────────────────────────────────────────────────


def test_only_runnable_blocks_are_extracted(tmp_path):
    commands = _commands(PAGE, tmp_path)
    assert [c.text for c in commands] == [
        "raygym plan --preset qwen3-4b",
        "raygym train --num-rollout 3 --output-dir runs/x",
        "python -m raygym.train --num-rollout 2",
    ]
    assert [c.line for c in commands] == [4, 5, 20]
    assert commands[1].words == ("raygym", "train", "--num-rollout", "3", "--output-dir", "runs/x")
    blocks = fenced_blocks(PAGE, tmp_path / "page.md")
    assert [b.runnable for b in blocks] == [True, False, False, True]


def test_info_string_needs_bash_then_runnable():
    text = "```python runnable\nx\n```\n```runnable\ny\n```\n```bash  runnable extra\nraygym plan\n```\n"
    assert [b.runnable for b in fenced_blocks(text, Path("p.md"))] == [False, False, True]


def test_commands_run_as_this_interpreter(tmp_path):
    raygym, train, code = _commands(
        "```bash runnable\nraygym plan --lr 1e-6\npython -m raygym.train --num-rollout 2\n"
        "python -c \"print('x # not a comment')\"\n```\n", tmp_path)
    assert raygym.argv("PY") == ["PY", "-m", "raygym", "plan", "--lr", "1e-6"]
    assert train.argv("PY") == ["PY", "-m", "raygym", "train", "--num-rollout", "2"]
    assert code.argv("PY") == ["PY", "-c", "print('x # not a comment')"]


@pytest.mark.parametrize("line, complaint", [
    ("raygmy plan", "known program"),
    ("pyhton -m raygym plan", "known program"),
    ("raygym plan && raygym train", "shell syntax '&&'"),
    ("raygym report runs/x > out.html", "shell syntax '>'"),
    ("RAY_ADDRESS=auto raygym serve runs/x", "environment variable"),
    ("raygym train --output-dir $HOME/r", "expansion"),
])
def test_a_line_that_is_not_one_known_program_call_fails(tmp_path, line, complaint):
    with pytest.raises(DocCommandError, match=complaint):
        for command in _commands(f"```bash runnable\n{line}\n```\n", tmp_path):
            check_command(command)


@pytest.mark.parametrize("line, complaint", [
    ("raygym tran --num-rollout 3", "'tran' is not a raygym command"),
    ("raygym data prepar x --out y", "'data prepar' is not a raygym command"),
    ("raygym plan --presett qwen3-4b", "presett"),
    ("raygym train --num-rollout three", "num_rollout"),
    ("raygym report --ot r.html runs/x", "--ot"),
    ("raygym data prepare x.jsonl", "--out"),
    ("python -c \"print(1\"", "does not compile"),
])
def test_a_typo_in_a_runnable_command_fails(tmp_path, line, complaint):
    (command,) = _commands(f"```bash runnable\n{line}\n```\n", tmp_path)
    with pytest.raises(DocCommandError, match=complaint):
        check_command(command)


# ── the docs themselves ──────────────────────────────────────────────────────────────────────────

DOC_COMMANDS = [c for p in doc_files() for c in page_commands(p)]


def test_the_docs_have_runnable_commands():
    pages = {c.path.name for c in DOC_COMMANDS}
    assert {"README.md", "training.md", "serving.md", "data.md"} <= pages, pages
    assert any(c.raygym_args[:1] == ["train"] for c in DOC_COMMANDS if c.path == REPO_ROOT / "README.md")
    assert len(runnable_blocks()) >= len(pages)


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: c.where)
def test_runnable_command_is_valid(command):
    check_command(command)


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_point_at_files(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# Weight sync: full, delta\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#weight-sync-full-delta) [url](https://x.org/none.md)\n"
                    "[gone](missing.md) [bad anchor](there.md#nope)\n```\n[in code](missing2.md)\n```\n")
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "missing.md (no such file)", "there.md#nope (no heading #nope in there.md)"]


def test_a_block_cannot_end_inside_a_continued_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash runnable\nraygym train \\\n```\n")
    (block,) = fenced_blocks(page.read_text(), page)
    with pytest.raises(DocCommandError, match="continued line"):
        block_commands(block)


# ── the README's set-up commands: a contract with .ci/run ────────────────────────────────────────

MARKER_EXPRESSION = re.compile(r'pytest -m "([^"]+)"')


def test_readme_set_up_commands_are_the_ones_ci_runs():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    ") and "pytest -m" in line]
    assert any(c.startswith("pip install torch==2.13.0 && pip install -e '.[dev]' && pytest -m") for c in commands)
    assert "    pip install torch==2.13.0 && pip install -e '.[dev]' && raygym train\n" in readme
    ci_expressions = set(MARKER_EXPRESSION.findall(ci))
    for command in commands:
        if command.endswith("--durations=20"):  # the two suites CI runs (the fast lane is for editing)
            assert MARKER_EXPRESSION.findall(command)[0] in ci_expressions, command


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_marker_expressions_leave_out_the_wheel_tests(page):
    for expression in MARKER_EXPRESSION.findall(page.read_text()):
        assert not expression.endswith("and not vllm_cpu"), f"{page.name}: {expression!r} needs 'and not wheel'"
