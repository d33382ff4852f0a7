"""Run one untrusted Python program in a sandbox and collect what it printed.

:class:`Sandbox` owns one unprivileged uid (claimed with a lock file, so two sandboxes never share
one, also across processes), runs one program at a time as that uid inside the namespaces of
:mod:`raygym.sandbox.isolation`, enforces the wall-clock timeout by killing the whole process group,
and afterwards kills whatever process of its uid is left (so nothing it started outlives the run).

>>> box = Sandbox()                                      # doctest: +SKIP
>>> box.run("print(6 * 7)").stdout                       # doctest: +SKIP
'42\\n'
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raygym.errors import RaygymError
from raygym.sandbox.isolation import Limits, backend_argv, detect_backend, python_executable

UID_RANGE = range(61000, 61512)
LOCK_DIR = Path("/tmp/raygym-sandbox-uids")
BOOTSTRAP = "import sys\nsource = sys.stdin.read()\nsys.stdin.close()\nexec(compile(source, '<sandbox>', 'exec'), {'__name__': '__main__'})\n"


@dataclass
class RunResult:
    """How a sandboxed run ended."""

    exit_code: int | None  # None when it was killed for the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    leftover_processes: int  # processes of the sandbox's uid killed after the run

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def processes_of(uid: int) -> list[int]:
    """Pids of running processes whose real uid is ``uid`` (zombies, which hold no memory and wait for
    their reaper, are left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
                found.append(int(entry))
        except (OSError, ValueError, KeyError):
            continue
    return found


def _claim_uid() -> tuple[int, int]:
    """(uid, lock fd): the first uid of UID_RANGE whose lock file no live process holds."""
    LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
    for uid in UID_RANGE:
        fd = os.open(LOCK_DIR / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise RaygymError(f"every sandbox uid in {UID_RANGE.start}..{UID_RANGE.stop - 1} is in use; end other sandboxes")


class Sandbox:
    """One isolated runner. ``backend``: ``bwrap`` | ``unshare`` | None (the first that works).

    Run as root it claims its own uid (so the process limit and the final clean-up cover exactly its
    processes); otherwise it runs as the current user.
    """

    def __init__(self, limits: Limits | None = None, backend: str | None = None) -> None:
        self.limits = limits or Limits()
        self._lock_fd: int | None = None
        if os.geteuid() == 0:
            self.uid, self._lock_fd = _claim_uid()
        else:
            self.uid = os.geteuid()
        self.backend = detect_backend(backend, self.uid if os.geteuid() == 0 else None)
        self.python = python_executable()
        self._serial = threading.Lock()  # one run at a time: the clean-up kills every process of the uid

    def close(self) -> None:
        """Release the uid (idempotent)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def run(self, source: str, limits: Limits | None = None) -> RunResult:
        """Run the Python program ``source`` (read from stdin by a tiny bootstrap) and return its output."""
        limits = limits or self.limits
        argv = backend_argv(self.backend, limits, [self.python, "-I", "-S", "-c", BOOTSTRAP])
        as_root = os.geteuid() == 0
        with self._serial:
            started = time.monotonic()
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True, cwd="/",
                user=self.uid if as_root else None, group=self.uid if as_root else None,
                extra_groups=[] if as_root else None, env={"PATH": "/usr/bin:/bin"},
            )
            timed_out = False
            readers = [_BoundedReader(proc.stdout, limits.output_bytes), _BoundedReader(proc.stderr, limits.output_bytes)]
            try:
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(source.encode())
                    proc.stdin.close()
                except BrokenPipeError:  # it died before reading its program; its exit code says why
                    pass
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            except BaseException:
                _kill_group(proc.pid)
                proc.wait()
                raise
            out, err = (reader.result(timeout=5.0) for reader in readers)
            leftovers = self._kill_leftovers() if as_root else 0
            return RunResult(
                exit_code=None if timed_out else proc.returncode,
                stdout=out.decode(errors="replace"),
                stderr=err.decode(errors="replace"),
                timed_out=timed_out, seconds=time.monotonic() - started, leftover_processes=leftovers,
            )

    def _kill_leftovers(self) -> int:
        """SIGKILL every process of this sandbox's uid until none is left; returns how many there were."""
        killed: set[int] = set()
        for _ in range(50):
            pids = processes_of(self.uid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)  # the kernel reaps them asynchronously
        return len(killed)


class _BoundedReader:
    """Drains a pipe on a thread, keeping at most ``cap`` bytes: a program that floods its output cannot
    fill the host's memory (nor block on a full pipe)."""

    def __init__(self, stream: Any, cap: int) -> None:
        self.stream, self.cap = stream, cap
        self.kept = bytearray()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while chunk := self.stream.read1(65536):
            room = self.cap - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]

    def result(self, timeout: float) -> bytes:
        # The group is dead; a grandchild that escaped the group could still hold the pipe: don't wait forever.
        self.thread.join(timeout)
        return bytes(self.kept)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
