"""What the sandboxed processes run: ``python3 -I -S -c BOOTSTRAP`` with, on stdin, a few modules of
this package and then the payload (the candidate's code, or the grader's tests).

The modules go as code objects compiled here (``marshal``) when the sandbox's interpreter reads this
interpreter's bytecode (same magic number), which saves each process compiling them; else as source.
The bootstrap defines them under their own names (``raygym.sandbox.wire``...) in the fresh
interpreter, which cannot import raygym, then runs one entry statement.

>>> b"raygym.sandbox.wire" in stdin_for(("wire",), b"payload", ship_code=False)
True
"""

from __future__ import annotations

import functools
import importlib.util
import marshal
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Reads stdin (4-byte length, marshalled [(name, code or source)], payload), defines the modules.
_BOOTSTRAP = """import sys, marshal
def _load():
    data = sys.stdin.buffer.read()
    sys.stdin.close()
    size = int.from_bytes(data[:4], "little")
    package = sys.modules["raygym.sandbox"] = type(sys)("raygym.sandbox")
    sys.modules["raygym"] = type(sys)("raygym")
    sys.modules["raygym"].sandbox = package
    for name, code in marshal.loads(data[4:4 + size]):
        module = sys.modules[name] = type(sys)(name)
        setattr(package, name.rpartition(".")[2], module)
        exec(compile(code, "<" + name + ">", "exec") if type(code) is str else code, module.__dict__)
    return data[4 + size:]
payload = _load()
del _load
"""


@functools.cache
def _source(module: str) -> str:
    return (HERE / f"{module}.py").read_text()


@functools.cache
def _compiled(module: str) -> bytes:
    return marshal.dumps(compile(_source(module), f"<raygym.sandbox.{module}>", "exec"))


@functools.lru_cache(maxsize=4)
def reads_our_bytecode(python: str) -> bool:
    """Whether ``python`` runs code objects compiled by this interpreter (the same bytecode magic)."""
    probe = "import sys; print(sys.modules['_frozen_importlib_external'].MAGIC_NUMBER.hex())"
    try:
        done = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == importlib.util.MAGIC_NUMBER.hex()


def stdin_for(modules: tuple[str, ...], payload: bytes, ship_code: bool) -> bytes:
    """The bootstrap's stdin: ``modules`` (compiled when ``ship_code``), then ``payload``."""
    entries = [(f"raygym.sandbox.{m}", marshal.loads(_compiled(m)) if ship_code else _source(m)) for m in modules]
    blob = marshal.dumps(entries)
    return len(blob).to_bytes(4, "little") + blob + payload


def _stage_line(stage_call: str | None) -> str:
    return f"from raygym.sandbox import stage\n{stage_call}\n" if stage_call else ""


def run_program(stage_call: str | None) -> tuple[str, tuple[str, ...]]:
    """A single run: (bootstrap, modules); the optional stage, then the payload runs as ``__main__``."""
    entry = "exec(compile(payload.decode(), '<sandbox>', 'exec'), {'__name__': '__main__'})\n"
    return _BOOTSTRAP + _stage_line(stage_call) + entry, (("stage",) if stage_call else ())


def candidate_program(stage_call: str | None, request_fd: int, reply_fd: int,
                      max_bytes: int) -> tuple[str, tuple[str, ...]]:
    """The candidate of a graded run: the optional stage, then :func:`raygym.sandbox.candidate.main`."""
    entry = f"from raygym.sandbox import candidate\ncandidate.main({request_fd}, {reply_fd}, {max_bytes}, payload)\n"
    return _BOOTSTRAP + _stage_line(stage_call) + entry, (("stage",) if stage_call else ()) + ("wire", "candidate")


def grader_program(stage_call: str | None, request_fd: int, reply_fd: int, max_bytes: int,
                   undumpable: bool) -> tuple[str, tuple[str, ...]]:
    """The grader of a graded run: the optional stage, then :func:`raygym.sandbox.grader.main`."""
    entry = f"from raygym.sandbox import grader\ngrader.main({request_fd}, {reply_fd}, {max_bytes}, {undumpable}, payload)\n"
    return _BOOTSTRAP + _stage_line(stage_call) + entry, (("stage",) if stage_call else ()) + ("wire", "grader")
