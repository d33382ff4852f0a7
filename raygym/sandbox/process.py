"""Processes of the sandbox's host side: starting one (optionally held until it is in a memory
cgroup), draining its output with a bound, killing its process group or every process of a uid.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raygym.sandbox.memcg import MemoryCgroup


@dataclass
class RunResult:
    """How a sandboxed process ended."""

    exit_code: int | None  # None when it was killed for the wall-clock timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    leftover_processes: int  # processes of the sandbox's uids killed after the run

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class BoundedReader:
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

    def result(self, timeout: float) -> str:
        # The group is dead; a grandchild that escaped the group could still hold the pipe: don't wait forever.
        self.thread.join(timeout)
        return bytes(self.kept).decode(errors="replace")


class Child:
    """One started process: its own session and process group, stdin written and closed, stdout and
    stderr drained with a bound."""

    def __init__(self, argv: Sequence[str], *, uid: int | None, stdin: bytes, output_cap: int,
                 pass_fds: Sequence[int] = (), cgroup: MemoryCgroup | None = None) -> None:
        # setpriv: killed when the thread that started it dies (a host that crashes mid-run takes the run
        # with it), and the uid switch (rather than Popen(user=), which rules out vfork: a big host forks slowly).
        ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        argv = ["setpriv", *ids, "--pdeathsig=KILL", "--", *argv]
        if cgroup is not None:  # held until it is in the cgroup (a first line on stdin), so nothing escapes it
            argv = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "sandbox", *argv]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            close_fds=True, pass_fds=tuple(pass_fds), cwd="/", env={"PATH": "/usr/bin:/bin"},
        )
        self.stdout = BoundedReader(self.proc.stdout, output_cap)
        self.stderr = BoundedReader(self.proc.stderr, output_cap)
        # A pidfd turns readable when the process exits, before it is reaped: until we reap it, its pid
        # cannot be reused, so killing its process group never reaches a stranger's.
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            self._pidfd = -1
        if cgroup is not None:
            try:
                cgroup.add(self.proc.pid)
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"go\n")  # sh reads a pipe byte by byte: the program gets the rest
                self.proc.stdin.flush()
            except BaseException:
                self.kill()
                raise
        self._stdin = stdin

    def feed(self) -> None:
        """Write its stdin and close it, on a thread (a process that does not read cannot block us; one
        that died first just misses it)."""
        threading.Thread(target=self._write_stdin, daemon=True).start()

    def _write_stdin(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(self._stdin)
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError, OSError):  # it died, or kill() closed the pipe
            pass

    def wait(self, timeout: float) -> bool:
        """Whether it exited within ``timeout`` seconds (it is not reaped yet: see :meth:`kill`)."""
        if self._pidfd < 0:
            try:
                self.proc.wait(timeout=max(timeout, 0.0))
                return True
            except subprocess.TimeoutExpired:
                return False
        readable, _, _ = select.select([self._pidfd], [], [], max(timeout, 0.0))
        return bool(readable)

    def kill(self) -> None:
        """SIGKILL its process group (while its pid still names the group), then reap it."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def result(self, timed_out: bool, leftovers: int) -> RunResult:
        return RunResult(
            exit_code=None if timed_out else self.proc.returncode, stdout=self.stdout.result(5.0),
            stderr=self.stderr.result(5.0), timed_out=timed_out, seconds=time.monotonic() - self.started,
            leftover_processes=leftovers,
        )


def processes_of(*uids: int) -> list[int]:
    """Pids of running processes whose real uid is one of ``uids`` (zombies, which hold no memory and
    wait for their reaper, are left out)."""
    wanted = {str(uid) for uid in uids}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                state = uid = ""
                for line in fh:
                    if line.startswith("State:"):
                        state = line.split()[1]
                    elif line.startswith("Uid:"):
                        uid = line.split()[1]
                        break
            if uid in wanted and state not in ("Z", "X"):
                found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def kill_until_gone(list_pids: Callable[[], list[int]]) -> int:
    """SIGKILL the processes ``list_pids()`` names until it names none; returns how many there were."""
    killed: set[int] = set()
    for _ in range(50):
        pids = list_pids()
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


def kill_processes_of(uids: Sequence[int]) -> int:
    """SIGKILL every process of ``uids`` until none is left; returns how many there were."""
    return kill_until_gone(lambda: processes_of(*uids)) if uids else 0
