"""The seccomp filter: what it answers for each call (evaluated by a small classic-BPF interpreter, for
x86_64 and aarch64), its syscall numbers against the kernel headers, and the filter in force inside
the sandbox on every backend."""

from __future__ import annotations

import ast
import errno
import re
import struct
from pathlib import Path

import pytest

from raygym.sandbox.seccomp import (
    AUDIT_ARCH,
    CLONE_NEW_FLAGS,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    SYSCALLS,
    TIOCSTI,
    build_filter,
    host_arch,
)

CLONE_NEWUSER = 0x10000000
SIGCHLD = 17
AF_UNIX, AF_INET, AF_NETLINK = 1, 2, 16


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """Evaluate a classic BPF seccomp program on ``struct seccomp_data`` {nr, arch, ip, args[6]}."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")


def nr_of(name: str, arch: str) -> int:
    number = SYSCALLS[name][0 if arch == "x86_64" else 1]
    assert number is not None
    return number


@pytest.mark.parametrize("arch", sorted(AUDIT_ARCH))
def test_filter_refuses_what_a_scored_program_never_needs(arch):
    program = build_filter(arch)
    audit = AUDIT_ARCH[arch]

    def answer(name_or_nr, *args, allow_unix=True):
        nr = name_or_nr if isinstance(name_or_nr, int) else nr_of(name_or_nr, arch)
        return run_bpf(program if allow_unix else build_filter(arch, allow_unix_sockets=False), nr, audit, args)

    eperm = RET_ERRNO | errno.EPERM
    for name in ("mount", "umount2", "pivot_root", "ptrace", "process_vm_writev", "bpf", "keyctl", "unshare", "setns",
                 "memfd_create", "shmget", "msgget", "semget", "mq_open", "io_uring_setup", "perf_event_open",
                 "userfaultfd", "open_by_handle_at", "init_module", "kexec_load", "fsopen", "move_mount"):
        assert answer(name) == eperm, name
    assert answer("clone3") == RET_ERRNO | errno.ENOSYS  # the C library falls back to clone
    assert answer("clone", SIGCHLD) == RET_ALLOW  # fork
    assert answer("clone", 0x3D0F00) == RET_ALLOW  # a thread (CLONE_VM | CLONE_FS | ... | CLONE_THREAD ...)
    assert answer("clone", CLONE_NEWUSER | SIGCHLD) == eperm
    assert all(answer("clone", 1 << b) == eperm for b in range(32) if (1 << b) & CLONE_NEW_FLAGS)
    assert answer("socket", AF_UNIX) == RET_ALLOW
    assert answer("socket", AF_INET) == RET_ERRNO | errno.EAFNOSUPPORT
    assert answer("socket", AF_NETLINK) == RET_ERRNO | errno.EAFNOSUPPORT
    assert answer("socket", AF_UNIX, allow_unix=False) == eperm
    assert answer("ioctl", 1, TIOCSTI) == eperm
    assert answer("ioctl", 1, 0x5401) == RET_ALLOW  # TCGETS
    for allowed in (0, 1, 2, 3, 9, 60, 62):  # ordinary calls (read/write/open... on either table) pass
        if allowed not in {n for n in (SYSCALLS[k][0 if arch == "x86_64" else 1] for k in SYSCALLS) if n is not None}:
            assert answer(allowed) == RET_ALLOW
    other_arch = next(a for a in AUDIT_ARCH.values() if a != audit)
    assert run_bpf(program, 0, other_arch) == RET_KILL_PROCESS
    assert run_bpf(program, 0, 0x40000003) == RET_KILL_PROCESS  # i386 (int 0x80 on x86_64)
    if arch == "x86_64":
        assert run_bpf(program, 0x40000000 | 0, audit) == RET_ERRNO | errno.ENOSYS  # the x32 ABI


HEADERS = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
           "aarch64": Path("/usr/include/asm-generic/unistd.h")}


@pytest.mark.parametrize("arch", sorted(HEADERS))
def test_syscall_numbers_match_the_kernel_headers(arch):
    header = HEADERS[arch]
    if not header.exists():
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", header.read_text())}
    column = 0 if arch == "x86_64" else 1
    for name, numbers in SYSCALLS.items():
        if numbers[column] is None:
            assert name not in defined, f"{name} exists on {arch}"
        else:
            assert defined.get(name) == numbers[column], name


DENIED_INSIDE = ["mount", "umount2", "pivot_root", "unshare", "setns", "ptrace", "bpf", "keyctl", "add_key",
                 "memfd_create", "shmget", "msgget", "semget", "userfaultfd", "perf_event_open", "io_uring_setup",
                 "process_vm_readv", "kexec_load", "init_module", "open_by_handle_at"]


def test_the_filter_is_in_force_inside_the_sandbox(box):
    arch = host_arch()
    numbers = {name: nr_of(name, arch) for name in DENIED_INSIDE}
    program = f"""
import ctypes, os, socket, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
errors = {{}}
for name, nr in {numbers!r}.items():
    ctypes.set_errno(0)
    result = libc.syscall(nr, 0, 0, 0, 0, 0, 0)
    errors[name] = ctypes.get_errno() if result == -1 else 'succeeded'
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
t = threading.Thread(target=lambda: None); t.start(); t.join()  # threads still start (clone3 -> clone)
pid = os.fork()
if pid == 0:
    os._exit(7)
forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
a, b = socket.socketpair(); a.sendall(b'x')
echo = subprocess.run(['/usr/bin/echo', 'hi'], capture_output=True).stdout
print(repr((errors, status['Seccomp'].strip(), status['NoNewPrivs'].strip(), forked, b.recv(1), echo)))
"""
    result = box.run(program)
    assert result.exit_code == 0, result.stderr
    errors, mode, no_new_privs, forked, paired, echo = ast.literal_eval(result.stdout)
    assert errors == {name: errno.EPERM for name in DENIED_INSIDE}
    assert (mode, no_new_privs, forked, paired, echo) == ("2", "1", 7, b"x", b"hi\n")
