"""The seccomp filter of a sandboxed program, built as a classic BPF program in pure Python (no
libseccomp): the system calls a scored program never needs fail with ``EPERM``.

Denied: mounting and changing roots (``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount
API), new namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag; ``clone3`` answers
``ENOSYS`` so the C library falls back to ``clone``, whose flags the filter can read), reading or
writing other processes (``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``, ``kcmp``,
``process_madvise``), kernel attack surface a program has no use for (``bpf``, ``perf_event_open``,
``userfaultfd``, ``io_uring_*``, the key ring, modules, ``kexec``, ``reboot``, swap, clocks, quotas,
``syslog``, file handles), memory outside the sandbox's file systems (``memfd_create``,
``memfd_secret``, System V shared memory, message queues and semaphores, POSIX message queues),
faking terminal input (``ioctl`` ``TIOCSTI``/``TIOCLINUX``) and sockets of any family but ``AF_UNIX``
(``socket`` entirely when ``allow_unix_sockets`` is off: without a network namespace a unix socket
could reach the host's). Any other architecture than the one the filter was built for (e.g. 32-bit
calls on x86_64, or the x32 ABI) is killed or refused.

>>> program = build_filter("x86_64")
>>> len(program) % 8, program[:8] == bytes([0x20, 0, 0, 0, 4, 0, 0, 0])  # first: load the arch
(0, True)
"""

from __future__ import annotations

import errno
import platform
import struct

# name: (x86_64 number, aarch64 number); None where the architecture has no such call.
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268), "clone": (56, 220), "clone3": (435, 435),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272), "process_madvise": (440, 440),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89), "quotactl": (179, 60),
    "quotactl_fd": (443, 443), "syslog": (103, 116), "settimeofday": (164, 170),
    "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    "iopl": (172, None), "ioperm": (173, None), "modify_ldt": (154, None), "uselib": (134, None),
    "ustat": (136, None), "sysfs": (139, None), "_sysctl": (156, None), "nfsservctl": (180, 42),
    "lookup_dcookie": (212, 18), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "vhangup": (153, 58), "sethostname": (170, 161), "setdomainname": (171, 162),
    "move_pages": (279, 239), "migrate_pages": (256, 238), "fanotify_init": (300, 262),
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197),
    "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "mq_timedsend": (242, 182),
    "mq_timedreceive": (243, 183), "mq_notify": (244, 184), "mq_getsetattr": (245, 185),
    "socket": (41, 198), "ioctl": (16, 29),
}
# Refused outright (the calls with an argument rule, clone, clone3, socket and ioctl, are handled apart).
DENIED = tuple(name for name in SYSCALLS if name not in ("clone", "clone3", "socket", "ioctl"))

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
CLONE_NEW_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
OFFSET_NR, OFFSET_ARCH = 0, 4


def arg_offset(index: int) -> int:
    """Offset of the low 32 bits of syscall argument ``index`` in ``struct seccomp_data`` (little endian)."""
    return 16 + 8 * index


class UnsupportedArchitecture(RuntimeError):
    """No syscall table for this machine's architecture."""


def host_arch() -> str:
    machine = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter(arch: str | None = None, allow_unix_sockets: bool = True) -> bytes:
    """The filter for ``arch`` (default: this machine's) as ``struct sock_filter`` records, the form
    ``bwrap --seccomp FD`` reads and ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)`` takes."""
    arch = arch or host_arch()
    if arch not in AUDIT_ARCH:
        raise UnsupportedArchitecture(f"no seccomp syscall table for {arch!r} (known: {sorted(AUDIT_ARCH)})")
    column = 0 if arch == "x86_64" else 1

    def nr(name: str) -> int | None:
        return SYSCALLS[name][column]

    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    out = [_insn(LD_ABS_W, OFFSET_ARCH), _insn(JEQ_K, AUDIT_ARCH[arch], jt=1), _insn(RET_K, RET_KILL_PROCESS),
           _insn(LD_ABS_W, OFFSET_NR)]
    if arch == "x86_64":
        out += [_insn(JGE_K, X32_SYSCALL_BIT, jf=1), _insn(RET_K, enosys)]
    for name in DENIED:
        number = nr(name)
        if number is not None:
            out += [_insn(JEQ_K, number, jf=1), _insn(RET_K, eperm)]
    out += [_insn(JEQ_K, _required(nr("clone3")), jf=1), _insn(RET_K, enosys)]
    # clone: refused when its flags (argument 0) ask for a new namespace.
    out += [_insn(JEQ_K, _required(nr("clone")), jf=4), _insn(LD_ABS_W, arg_offset(0)),
            _insn(JSET_K, CLONE_NEW_FLAGS, jf=1), _insn(RET_K, eperm), _insn(RET_K, RET_ALLOW)]
    # socket: only AF_UNIX (argument 0), or nothing.
    if allow_unix_sockets:
        out += [_insn(JEQ_K, _required(nr("socket")), jf=4), _insn(LD_ABS_W, arg_offset(0)),
                _insn(JEQ_K, AF_UNIX, jf=1), _insn(RET_K, RET_ALLOW), _insn(RET_K, RET_ERRNO | errno.EAFNOSUPPORT)]
    else:
        out += [_insn(JEQ_K, _required(nr("socket")), jf=1), _insn(RET_K, eperm)]
    # ioctl: no faked terminal input (argument 1 is the request).
    out += [_insn(JEQ_K, _required(nr("ioctl")), jf=5), _insn(LD_ABS_W, arg_offset(1)),
            _insn(JEQ_K, TIOCSTI, jt=1), _insn(JEQ_K, TIOCLINUX, jf=1), _insn(RET_K, eperm),
            _insn(RET_K, RET_ALLOW)]
    out.append(_insn(RET_K, RET_ALLOW))
    return b"".join(out)


def _required(number: int | None) -> int:
    assert number is not None
    return number
