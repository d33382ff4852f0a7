"""How a sandboxed process is isolated: the command line that wraps it.

Two backends, chosen by :func:`detect_backend` (probed once per process):

- ``bwrap`` (Debian's ``bubblewrap``): new user, network, PID, IPC, UTS and cgroup namespaces; a root
  file system of read-only ``/usr`` (plus the merged-``/usr`` links), a fresh ``/proc`` and ``/dev``,
  and a size-limited private ``tmpfs`` on ``/tmp`` as the only writable place; no host directory is
  mounted; the environment is cleared; the process dies with its parent.
- ``unshare`` (util-linux), where bubblewrap is missing or refused: new user (mapped to root inside),
  network, PID, mount, IPC and UTS namespaces with private ``tmpfs`` over ``/tmp``, ``/var/tmp`` and
  ``/dev/shm``. The rest of the host file system stays visible read-only for anything the sandbox's
  own uid cannot write; bubblewrap is the stronger choice.

Both run as a dedicated unprivileged uid under resource limits set by ``prlimit`` (CPU seconds,
address space, file size, processes, open files, no core files). The program comes on stdin, so
nothing is written on the host.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass

from raygym.errors import RaygymError

BACKENDS = ("bwrap", "unshare")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(RaygymError):
    """Neither bubblewrap nor unshare can create the namespaces on this machine."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 512 * 1024 * 1024  # address space (RLIMIT_AS)
    file_bytes: int = 16 * 1024 * 1024  # largest file it may write (RLIMIT_FSIZE)
    tmp_bytes: int = 32 * 1024 * 1024  # size of its private /tmp
    processes: int = 16  # processes of its uid (RLIMIT_NPROC)
    open_files: int = 64
    output_bytes: int = 1024 * 1024  # stdout/stderr kept (the rest is dropped)

    def prlimit_argv(self) -> list[str]:
        return [
            "prlimit", f"--cpu={self.cpu_seconds}", f"--as={self.memory_bytes}", f"--fsize={self.file_bytes}",
            f"--nproc={self.processes}", f"--nofile={self.open_files}", "--core=0", "--",
        ]


def python_executable() -> str:
    """The interpreter the sandbox runs: the system's python3 (found under /usr, which every backend
    mounts), not a virtualenv's."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if shutil.which(candidate):
            return candidate
    raise SandboxUnavailable("no /usr/bin/python3: the sandbox runs the system Python; install python3")


def bwrap_argv(limits: Limits, program_argv: list[str]) -> list[str]:
    """bubblewrap's command line around ``program_argv``."""
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        argv += ["--symlink", f"usr/{link}", f"/{link}"]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc", "--dev", "/dev",
             "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv",
             "--setenv", "PATH", SANDBOX_PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--"]
    return argv + program_argv


def unshare_argv(limits: Limits, program_argv: list[str]) -> list[str]:
    """unshare's command line around ``program_argv`` (a shell mounts the private temp dirs first)."""
    size = max(limits.tmp_bytes // 1024, 64)
    script = (f"mount -t tmpfs -o size={size}k,mode=1777 tmpfs /tmp && mount -t tmpfs -o size=1024k tmpfs /var/tmp"
              f" && mount -t tmpfs -o size=1024k tmpfs /dev/shm && cd /tmp && exec env -i PATH={SANDBOX_PATH} "
              'HOME=/tmp LANG=C.UTF-8 "$@"')
    return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
            "--ipc", "--uts", "--mount-proc", "--", "/bin/sh", "-c", script, "sandbox", *program_argv]


def backend_argv(backend: str, limits: Limits, program_argv: list[str]) -> list[str]:
    if backend == "bwrap":
        return limits.prlimit_argv() + bwrap_argv(limits, program_argv)
    if backend == "unshare":
        return limits.prlimit_argv() + unshare_argv(limits, program_argv)
    raise ValueError(f"backend={backend!r}: one of {BACKENDS}")


def _probe(backend: str, user: int | None) -> str | None:
    """None when ``backend`` runs a trivial program in its namespaces, else why not."""
    tool = "bwrap" if backend == "bwrap" else "unshare"
    if shutil.which(tool) is None or shutil.which("prlimit") is None:
        return f"{tool} or prlimit is not installed"
    argv = backend_argv(backend, Limits(), [python_executable(), "-I", "-S", "-c", "print('ok')"])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, user=user, group=user,
                              extra_groups=[] if user is not None else None)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    return None


@functools.lru_cache(maxsize=4)
def detect_backend(preferred: str | None = None, user: int | None = None) -> str:
    """The first backend (``preferred`` first) whose namespaces work here for ``user``; raises
    :class:`SandboxUnavailable` saying why each failed."""
    order = [preferred] if preferred else list(BACKENDS)
    reasons = []
    for backend in order:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: one of {BACKENDS}")
        why = _probe(backend, user)
        if why is None:
            return backend
        reasons.append(f"{backend}: {why}")
    raise SandboxUnavailable(
        "cannot isolate generated code on this machine (" + "; ".join(reasons) + "); install bubblewrap "
        "(apt-get install bubblewrap) and allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
    )
