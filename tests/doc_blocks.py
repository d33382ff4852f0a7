"""The docs' runnable commands and links, read from README.md and docs/*.md.

A fenced block whose info string is ``bash runnable`` holds commands a user can run on a CPU: one program call
per line (a trailing ``\\`` continues it, ``#`` starts a comment), no shell syntax. tests/unit/test_docs_commands.py
checks them without running anything; tests/e2e/test_docs_runnable.py runs them.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = "runnable"
# What a runnable command may start with; the value says how it is run (see ``Command.argv``).
PROGRAMS = {
    ("raygym",): "raygym",
    ("python", "-m", "raygym"): "raygym",
    ("python", "-m", "raygym.train"): "raygym train",
    ("python", "-c"): "python -c",
}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_SHELL_PUNCTUATION = set("();<>|&")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


class DocCommandError(ValueError):
    """A runnable block's line that is not one call of a known program."""


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    """README.md and every page under docs/, in a fixed order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def where(path: Path, line: int) -> str:
    """``docs/x.md:12`` for messages and test ids."""
    try:
        name = path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        name = path.name
    return f"{name}:{line}"


@dataclass(frozen=True)
class Block:
    """One fenced block: its file, the line of its opening fence (from 1), its info string and its lines."""

    path: Path
    line: int
    info: str
    lines: tuple[str, ...]

    @property
    def runnable(self) -> bool:
        """True for ``bash runnable`` (the language first, then the word ``runnable``)."""
        words = self.info.split()
        return len(words) >= 2 and words[0] == "bash" and RUNNABLE in words[1:]


def fenced_blocks(text: str, path: Path) -> list[Block]:
    """Every fenced block of a markdown text (``` or ~~~, also indented inside list items).

    >>> [b.info for b in fenced_blocks("a\\n```bash runnable\\nraygym plan\\n```\\n  ~~~\\n  x\\n  ~~~\\n", Path("x.md"))]
    ['bash runnable', '']
    """
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or (opening["fence"][0] == "`" and "`" in opening["info"]):
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            raw = lines[j]
            body.append(raw[min(indent, len(raw) - len(raw.lstrip())):])
            j += 1
        blocks.append(Block(path, i + 1, opening["info"].strip(), tuple(body)))
        i = j + 1
    return blocks


@dataclass(frozen=True)
class Command:
    """One command of a runnable block: where it is, its text (continuations joined) and its words."""

    path: Path
    line: int
    text: str
    words: tuple[str, ...]

    @property
    def where(self) -> str:
        """``docs/x.md:12``."""
        return where(self.path, self.line)

    @property
    def program(self) -> str:
        """``raygym``, ``raygym train`` (``python -m raygym.train``) or ``python -c``; DocCommandError otherwise."""
        for prefix, program in PROGRAMS.items():
            if self.words[: len(prefix)] == prefix:
                return program
        known = ", ".join(" ".join(p) for p in PROGRAMS)
        raise DocCommandError(f"{self.where}: {self.text!r} does not start with a known program ({known})")

    @property
    def raygym_args(self) -> list[str]:
        """The arguments after ``raygym`` (``python -m raygym.train X`` is ``raygym train X``)."""
        program = self.program
        if program == "raygym":
            return list(self.words[1:] if self.words[0] == "raygym" else self.words[3:])
        if program == "raygym train":
            return ["train", *self.words[3:]]
        raise DocCommandError(f"{self.where}: {self.text!r} is not a raygym command")

    def argv(self, python: str = sys.executable) -> list[str]:
        """The process to start: ``raygym`` and ``python`` run as this interpreter (``python -m raygym ...``)."""
        if self.program == "python -c":
            return [python, *self.words[1:]]
        return [python, "-m", "raygym", *self.raygym_args]


def strip_comment(text: str) -> str:
    """The line without its comment: as in bash, ``#`` starts one only at the start of a word, outside quotes.

    >>> strip_comment("raygym eval r --prompt-data builtin:next-digit#eval '# kept'  # dropped")
    "raygym eval r --prompt-data builtin:next-digit#eval '# kept'"
    """
    quote = ""
    previous = " "
    for i, char in enumerate(text):
        if quote:
            if char == quote and not (quote == '"' and previous == "\\"):
                quote = ""
        elif char in "'\"" and previous != "\\":
            quote = char
        elif char == "#" and previous.isspace():
            return text[:i].rstrip()
        previous = char
    return text


def _check_one_call(text: str, place: str) -> None:
    """DocCommandError for shell syntax: operators, redirections, substitutions, leading VAR=value."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    tokens = list(lexer)
    bad = [t for t in tokens if set(t) <= _SHELL_PUNCTUATION]
    if bad:
        raise DocCommandError(f"{place}: {text!r} uses shell syntax {bad[0]!r}; a runnable line is one program call")
    if tokens and _ASSIGNMENT.match(tokens[0]):
        raise DocCommandError(f"{place}: {text!r} sets an environment variable; a runnable line is one program call")
    if "$" in text or "`" in text:
        raise DocCommandError(f"{place}: {text!r} needs the shell's expansion ($ or `); write the value out")


def block_commands(block: Block) -> list[Command]:
    """The commands of a block: continuation lines joined, comments and blank lines left out; shell syntax
    raises DocCommandError."""
    commands: list[Command] = []
    pending: list[str] = []
    start = 0
    for offset, raw in enumerate(block.lines):
        stripped = raw.strip()
        if not pending:
            start = block.line + 1 + offset
            if not stripped or stripped.startswith("#"):
                continue
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = strip_comment(" ".join(part for part in pending if part))
        pending = []
        place = where(block.path, start)
        try:
            _check_one_call(text, place)
            words = tuple(shlex.split(text))
        except ValueError as exc:
            if isinstance(exc, DocCommandError):
                raise
            raise DocCommandError(f"{place}: {text!r} does not parse as a command: {exc}") from exc
        if words:
            commands.append(Command(block.path, start, text, words))
    if pending:
        raise DocCommandError(f"{where(block.path, start)}: the block ends inside a continued line")
    return commands


def runnable_blocks(paths: list[Path] | None = None) -> list[Block]:
    """The runnable blocks of the given markdown files (default: README.md and docs/*.md)."""
    return [b for p in (paths or doc_files()) for b in fenced_blocks(p.read_text(), p) if b.runnable]


def page_commands(path: Path) -> list[Command]:
    """A page's runnable commands in the order a reader meets them."""
    return [c for b in fenced_blocks(path.read_text(), path) if b.runnable for c in block_commands(b)]


# ── links ──────────────────────────────────────────────────────────────────────────────────────────


def relative_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every markdown link or image that is not a URL or a bare ``#anchor``, outside code.

    >>> relative_links("[a](docs/x.md#y) [b](https://e.org) `[c](no.md)`\\n```\\n[d](no.md)\\n```\\n![e](p.png)")
    [(1, 'docs/x.md#y'), (5, 'p.png')]
    """
    fenced = {b.line + k for b in fenced_blocks(text, Path("-")) for k in range(len(b.lines) + 2)}
    found: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if number in fenced:
            continue
        for match in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group(1)
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            found.append((number, target))
    return found


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (lowercase, punctuation dropped, spaces to hyphens; repeats -1, -2).

    >>> sorted(heading_anchors("# A b\\n## Weight sync: full, delta\\n## A b\\n```\\n# not a heading\\n```"))
    ['a-b', 'a-b-1', 'weight-sync-full-delta']
    """
    fenced = {b.line + k for b in fenced_blocks(text, Path("-")) for k in range(len(b.lines) + 2)}
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None or number in fenced:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(path: Path) -> list[str]:
    """``file:line: target`` for each relative link of a page whose file (or heading anchor) does not exist."""
    broken: list[str] = []
    for number, target in relative_links(path.read_text()):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve()
        if not resolved.exists():
            broken.append(f"{where(path, number)}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{where(path, number)}: {target} (no heading #{anchor} in {file_part})")
    return broken
