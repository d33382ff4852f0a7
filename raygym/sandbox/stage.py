"""The first stage of a sandboxed process on the ``unshare`` and ``weak`` backends, run in the
sandbox's own interpreter before the program (bubblewrap does the same itself).

``isolate`` (``unshare`` backend, started by ``unshare --user --map-root-user --net --pid --fork
--mount --ipc --uts --cgroup``, so it is root of a user namespace of its own): builds a fresh root
on a small tmpfs holding only a read-only ``/usr`` (plus the merged-``/usr`` links and
``/etc/ld.so.cache``), a new ``/proc`` (its ``sys``, ``sysrq-trigger``, ``irq`` and ``bus`` read-only),
a read-only ``/dev`` with ``null``, ``zero``, ``full``, ``random`` and ``urandom`` only, and sized
tmpfs on ``/tmp`` and ``/dev/shm``; pivots into it and detaches the host's root, makes the root
read-only; drops every capability (bounding and ambient sets, securebits that keep uid 0 from
regaining any) and sets ``no_new_privs``; installs the seccomp filter; clears the environment.
Every step is checked, and any failure ends the process with :data:`FAILED` before the program
runs, so a machine that cannot isolate refuses rather than runs unconfined.

``restrict`` (``weak`` backend, no namespaces): ``no_new_privs`` and the seccomp filter only.

This module is shipped as source into the sandbox; it imports only ``ctypes``, ``os`` and ``sys``.
"""

from __future__ import annotations

import ctypes
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

FAILED = 125  # exit status of a stage that could not isolate
NEW_ROOT = "/tmp"  # mount point of the new root (in the sandbox's own mount namespace only)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a remount inside a user namespace must keep (they are locked)
LOCKED_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME,
                4096: MS_RELATIME}
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
SECUREBITS_LOCKED_NOROOT = 0xEF  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE, all locked
DEVICES = ("null", "zero", "full", "random", "urandom")
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus")

_libc = ctypes.CDLL(None, use_errno=True)


class StageError(RuntimeError):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise StageError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args: list[Any] = [None if v is None else v.encode() for v in (source, target, fstype)]
    _check(_libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), None if data is None else data.encode()),
           f"mount {target}")


def _locked_flags(path: str) -> int:
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in LOCKED_FLAGS.items() if flags & st)


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    for point in _mount_points_under(target):
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(point))


def _mount_points_under(target: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == target or p.startswith(target + "/")]


def _tmpfs(target: str, size: int, mode: str) -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(size, 4096)},mode={mode}")


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def build_root(tmp_bytes: int, shm_bytes: int) -> None:
    """The new root, assembled at :data:`NEW_ROOT` (see the module docs)."""
    root = NEW_ROOT
    _tmpfs(root, 1 << 20, "0755")
    for name in ("usr", "proc", "dev", "tmp", "etc"):
        os.mkdir(f"{root}/{name}")
    for link in ("bin", "lib", "lib64", "sbin"):
        os.symlink(f"usr/{link}", f"{root}/{link}")
    _bind_read_only("/usr", f"{root}/usr")
    if os.path.exists("/etc/ld.so.cache"):
        _touch(f"{root}/etc/ld.so.cache")
        _bind_read_only("/etc/ld.so.cache", f"{root}/etc/ld.so.cache")
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        if os.path.exists(f"{root}/proc/{name}"):
            _bind_read_only(f"{root}/proc/{name}", f"{root}/proc/{name}")
    _tmpfs(f"{root}/dev", 65536, "0755")
    for name in DEVICES:
        _touch(f"{root}/dev/{name}")
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(f"{root}/dev/shm")
    _tmpfs(f"{root}/dev/shm", shm_bytes, "1777")
    _mount(None, f"{root}/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _tmpfs(f"{root}/tmp", tmp_bytes, "1777")
    os.chdir(root)
    _check(_libc.syscall(_pivot_root_nr(), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _pivot_root_nr() -> int:
    return {"x86_64": 155, "aarch64": 41}[os.uname().machine]


def drop_capabilities() -> None:
    """No capability left, none to regain: securebits, bounding and ambient sets, then capset."""
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient capabilities")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: all zero
    _check(_libc.capset(header, data), "capset")


def install_seccomp(program: bytes) -> None:
    """``no_new_privs``, then the filter ``program`` (struct sock_filter records)."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _status() -> dict[str, str]:
    with open("/proc/self/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


def verify(capabilities_dropped: bool) -> None:
    status = _status()
    if status.get("Seccomp", "").strip() != "2" or status.get("NoNewPrivs", "").strip() != "1":
        raise StageError("the seccomp filter is not in place")
    if capabilities_dropped and any(int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")):
        raise StageError("capabilities are left")


def clear_environment(home: str) -> None:
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8"})


def _run(steps: Any) -> None:
    try:
        steps()
    except (OSError, StageError, KeyError, ValueError) as exc:
        sys.stderr.write(f"raygym sandbox: cannot isolate: {exc}\n")
        sys.stderr.flush()
        os._exit(FAILED)


def isolate(seccomp_hex: str, tmp_bytes: int, shm_bytes: int) -> None:
    """The ``unshare`` backend's stage (see the module docs)."""

    def steps() -> None:
        build_root(tmp_bytes, shm_bytes)
        drop_capabilities()
        install_seccomp(bytes.fromhex(seccomp_hex))
        verify(capabilities_dropped=True)
        clear_environment("/tmp")
        os.chdir("/tmp")

    _run(steps)


def restrict(seccomp_hex: str) -> None:
    """The ``weak`` backend's stage: ``no_new_privs`` and the filter, nothing else."""

    def steps() -> None:
        install_seccomp(bytes.fromhex(seccomp_hex))
        verify(capabilities_dropped=False)
        clear_environment("/nonexistent")

    _run(steps)
