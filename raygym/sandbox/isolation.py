"""How a sandboxed process is isolated: the command line that wraps it, starting it
(:func:`start_sandboxed`), and which backend this machine can use (:func:`detect_backend`).

Three backends; :func:`detect_backend` picks the first of the first two that works (probed once per
process) and refuses to run when neither does, unless the caller opted into the third:

- ``bwrap`` (Debian's ``bubblewrap``): new user, network, PID, IPC, UTS and cgroup namespaces; a root
  file system of read-only ``/usr`` (plus the merged-``/usr`` links), a fresh ``/proc`` and a
  read-only ``/dev``; the root itself read-only; sized tmpfs on ``/tmp`` and ``/dev/shm`` as the only
  writable places; no host directory is mounted; the environment is cleared; no capabilities; the
  seccomp filter of :mod:`raygym.sandbox.seccomp`; the process dies with its parent.
- ``unshare`` (util-linux), where bubblewrap is missing or refused: the same namespaces, and
  :func:`raygym.sandbox.stage.isolate` builds the same file system, drops every capability and
  installs the same filter before the program runs; if any step fails, the run fails (the probe
  then rules the backend out).
- ``weak``, only with ``allow_weak_isolation=True``: no namespaces at all, for machines that allow
  none (some containers). The program runs as its own uid (when the host runs as root) under the
  same limits and seccomp filter, without sockets; it can read whatever that uid can read on the
  host (and, run by an ordinary user, signal that user's other processes). The name says it: use it
  only for code you would run anyway.

Every backend runs under resource limits set by ``prlimit`` (CPU seconds, address space, file size,
processes, open files, no core files, no POSIX message queues). The program comes on stdin, so
nothing is written on the host.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import os
import shutil
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path

from raygym.errors import ConfigError, RaygymError
from raygym.sandbox import programs
from raygym.sandbox.memcg import MemoryCgroup
from raygym.sandbox.process import Child, RunResult, kill_processes_of, processes_of
from raygym.sandbox.seccomp import UnsupportedArchitecture, build_filter

BACKENDS = ("bwrap", "unshare")
WEAK_BACKEND = "weak"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
LOCK_DIR = Path("/tmp/raygym-sandbox-uids")  # lock files of the sandbox uids (see raygym.sandbox.runner)
PROBE_UID = 61511  # detect_backend's probe when root: one uid, claimed like the others
_PYTHON = ("-I", "-S", "-c")
MiB = 1024 * 1024


class SandboxUnavailable(RaygymError):
    """No backend can isolate generated code on this machine (and the weak one was not allowed)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run.

    ``memory_bytes`` is the run's whole memory budget. Its writable file systems (``/tmp`` and
    ``/dev/shm``, tmpfs held in memory) get ``tmp_bytes`` of it between them (a quarter to
    ``/dev/shm``); each process may map the rest (``RLIMIT_AS`` = ``memory_bytes - tmp_bytes``). Where
    the sandbox has a memory cgroup (:mod:`raygym.sandbox.memcg`), ``memory_bytes`` also bounds all its
    processes and files together.

    >>> Limits(memory_bytes=256 * MiB, tmp_bytes=32 * MiB).address_space_bytes // MiB
    224
    """

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * MiB
    file_bytes: int = 16 * MiB  # largest file it may write (RLIMIT_FSIZE)
    tmp_bytes: int = 32 * MiB  # its writable tmpfs together, out of memory_bytes
    processes: int = 16  # processes of its uid (RLIMIT_NPROC)
    open_files: int = 64
    output_bytes: int = 1024 * 1024  # stdout/stderr kept (the rest is dropped)
    message_bytes: int = 16 * MiB  # the largest answer the candidate may send its grader

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ConfigError(f"Limits.{field.name}={value!r}: must be positive")
        if self.tmp_bytes * 2 > self.memory_bytes:
            raise ConfigError(f"Limits.tmp_bytes={self.tmp_bytes}: the sandbox's files count against its memory "
                              f"and may take at most half of memory_bytes={self.memory_bytes}; lower tmp_bytes "
                              "or raise memory_bytes")
        if self.tmp_bytes < 256 * 1024:
            raise ConfigError(f"Limits.tmp_bytes={self.tmp_bytes}: at least 262144 (256 KiB)")

    @property
    def address_space_bytes(self) -> int:
        return self.memory_bytes - self.tmp_bytes

    @property
    def shm_bytes(self) -> int:
        return self.tmp_bytes // 4

    @property
    def private_tmp_bytes(self) -> int:
        return self.tmp_bytes - self.shm_bytes

    def prlimit_argv(self) -> list[str]:
        return [
            "prlimit", f"--cpu={self.cpu_seconds}", f"--as={self.address_space_bytes}", f"--fsize={self.file_bytes}",
            f"--nproc={self.processes}", f"--nofile={self.open_files}", "--core=0", "--msgqueue=0", "--",
        ]


def python_executable() -> str:
    """The interpreter the sandbox runs: the system's python3 (found under /usr, which every backend
    mounts), not a virtualenv's."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if shutil.which(candidate):
            return candidate
    raise SandboxUnavailable("no /usr/bin/python3: the sandbox runs the system Python; install python3")


@functools.lru_cache(maxsize=2)
def seccomp_program(allow_unix_sockets: bool) -> bytes:
    """The seccomp filter for this machine (cached)."""
    return build_filter(allow_unix_sockets=allow_unix_sockets)


def bwrap_argv(limits: Limits, seccomp_fd: int, program_argv: list[str]) -> list[str]:
    """bubblewrap's command line around ``program_argv``; ``seccomp_fd`` is an inherited descriptor
    that holds the filter (:func:`seccomp_program`)."""
    # --as-pid-1: the program is the namespace's init, and bwrap reaps it itself. Without it, bwrap's own
    # init process is left a zombie for the host's init to reap, and until it does, these zombies count
    # against RLIMIT_NPROC: a quick series of runs then fails with "Can't fork for pid 1".
    argv = ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        argv += ["--symlink", f"usr/{link}", f"/{link}"]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(limits.shm_bytes), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--perms", "1777", "--size", str(limits.private_tmp_bytes), "--tmpfs", "/tmp", "--remount-ro", "/",
             "--seccomp", str(seccomp_fd), "--chdir", "/tmp", "--clearenv",
             "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--"]
    return argv + program_argv


def unshare_argv(program_argv: list[str]) -> list[str]:
    """unshare's command line around ``program_argv`` (a Python program that starts with
    :func:`raygym.sandbox.stage.isolate`)."""
    return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
            "--ipc", "--uts", "--cgroup", "--", *program_argv]


def stage_call(backend: str, limits: Limits) -> str | None:
    """The Python statement a sandboxed program starts with on ``backend`` (None: bubblewrap did it)."""
    if backend == "unshare":
        return (f"stage.isolate({seccomp_program(True).hex()!r}, {limits.private_tmp_bytes}, "
                f"{limits.shm_bytes})")
    if backend == WEAK_BACKEND:
        return f"stage.restrict({seccomp_program(False).hex()!r})"
    return None


def backend_argv(backend: str, limits: Limits, program_argv: list[str], seccomp_fd: int | None = None) -> list[str]:
    """The whole command line: limits, then the backend's isolation around ``program_argv``."""
    if backend == "bwrap":
        assert seccomp_fd is not None, "bubblewrap reads its seccomp filter from an inherited descriptor"
        return limits.prlimit_argv() + bwrap_argv(limits, seccomp_fd, program_argv)
    if backend == "unshare":
        return limits.prlimit_argv() + unshare_argv(program_argv)
    if backend == WEAK_BACKEND:
        return limits.prlimit_argv() + program_argv
    raise ValueError(f"backend={backend!r}: one of {BACKENDS + (WEAK_BACKEND,)}")


class _SeccompPipe:
    """bubblewrap reads its filter from an inherited descriptor: a pipe holding the program."""

    def __init__(self, backend: str) -> None:
        self.read_fd = -1
        if backend == "bwrap":
            program = seccomp_program(True)
            self.read_fd, write_fd = os.pipe()
            os.write(write_fd, program)  # a few KiB: fits the pipe's buffer
            os.close(write_fd)

    def close(self) -> None:
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


def encode_source(text: str) -> bytes:
    """Program text as the sandboxed interpreter reads it (lone surrogates kept)."""
    return text.encode("utf-8", "surrogatepass")


def start_sandboxed(backend: str, limits: Limits, program: tuple[str, tuple[str, ...]], payload: bytes, *,
                    uid: int | None, cgroup: MemoryCgroup | None, pass_fds: tuple[int, ...] = ()) -> Child:
    """Start ``program`` (bootstrap, shipped modules; see :mod:`raygym.sandbox.programs`) with ``payload``
    isolated by ``backend``, as ``uid``, in ``cgroup``, inheriting ``pass_fds``. Not fed yet."""
    python = python_executable()
    bootstrap, modules = program
    stdin = programs.stdin_for(modules, payload, programs.reads_our_bytecode(python))
    seccomp = _SeccompPipe(backend)
    try:
        argv = backend_argv(backend, limits, [python, *_PYTHON, bootstrap], seccomp.read_fd if seccomp.read_fd >= 0 else None)
        fds = pass_fds + ((seccomp.read_fd,) if seccomp.read_fd >= 0 else ())
        return Child(argv, uid=uid, stdin=stdin, output_cap=limits.output_bytes, pass_fds=fds, cgroup=cgroup)
    finally:
        seccomp.close()


def _claim_probe_uid() -> tuple[int, int]:
    """The probe's uid, waiting for another process's probe to finish."""
    LOCK_DIR.mkdir(mode=0o755, exist_ok=True)
    fd = os.open(LOCK_DIR / str(PROBE_UID), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return PROBE_UID, fd


def probe_run(backend: str, as_root: bool, source: str) -> RunResult:
    """One short run of ``source`` on ``backend`` as the probe uid (as root), without detection."""
    limits = Limits()
    lock, uid = -1, None
    if as_root:
        uid, lock = _claim_probe_uid()
    else:
        limits = dataclasses.replace(limits, processes=limits.processes + len(processes_of(os.geteuid())))
    try:
        child = start_sandboxed(backend, limits, programs.run_program(stage_call(backend, limits)),
                                encode_source(source), uid=uid, cgroup=None)
        try:
            child.feed()
            finished = child.wait(30.0)
        finally:
            child.kill()
        leftovers = kill_processes_of([uid]) if uid is not None else 0
        return child.result(timed_out=not finished, leftovers=leftovers)
    finally:
        if lock >= 0:
            os.close(lock)


def _probe(backend: str, as_root: bool) -> str | None:
    """None when ``backend`` runs a trivial program fully isolated, else why not."""
    tool = {"bwrap": "bwrap", "unshare": "unshare", WEAK_BACKEND: "prlimit"}[backend]
    if shutil.which(tool) is None or shutil.which("prlimit") is None:
        return f"{tool} or prlimit is not installed"
    try:
        result = probe_run(backend, as_root, "print('ok')")
    except (OSError, subprocess.SubprocessError, UnsupportedArchitecture) as exc:
        return f"{type(exc).__name__}: {exc}"
    if result.exit_code != 0 or result.stdout.strip() != "ok":
        return f"exit {result.exit_code}: {result.stderr.strip()[-300:]}"
    return None


@functools.lru_cache(maxsize=8)
def detect_backend(preferred: str | None = None, as_root: bool = False, allow_weak_isolation: bool = False) -> str:
    """The first backend (``preferred`` only, when given) that isolates here; raises
    :class:`SandboxUnavailable` saying why each failed. ``weak`` is used (and may be preferred) only
    with ``allow_weak_isolation``. ``as_root``: probe as a sandbox uid, as a root host runs them."""
    known = BACKENDS + (WEAK_BACKEND,)
    if preferred is not None and preferred not in known:
        raise ConfigError(f"sandbox backend={preferred!r}: one of {known}")
    if preferred == WEAK_BACKEND and not allow_weak_isolation:
        raise ConfigError("sandbox backend='weak' runs generated code without namespaces; pass "
                          "allow_weak_isolation=True to mean it, or install bubblewrap")
    order = [preferred] if preferred else list(BACKENDS)
    reasons = []
    for backend in order:
        why = _probe(backend, as_root)
        if why is None:
            return backend
        reasons.append(f"{backend}: {why}")
    if allow_weak_isolation and preferred is None:
        why = _probe(WEAK_BACKEND, as_root)
        if why is None:
            return WEAK_BACKEND
        reasons.append(f"{WEAK_BACKEND}: {why}")
    raise SandboxUnavailable(
        "cannot isolate generated code on this machine (" + "; ".join(reasons) + "). Install bubblewrap "
        "(apt-get install bubblewrap) and allow unprivileged user namespaces (sysctl "
        "kernel.unprivileged_userns_clone=1, or user.max_user_namespaces > 0); or, for code you would run "
        "unsandboxed anyway, pass allow_weak_isolation=True (no namespaces: it sees the host's files)"
    )
