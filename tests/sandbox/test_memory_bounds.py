"""Memory the sandbox can hold stays within its budget on every backend: its writable file systems
share one sized budget (the rest is read-only), memory outside them (memfd, System V and POSIX IPC)
is refused, and, where a memory cgroup exists, all its processes together stay under the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raygym.errors import ConfigError
from raygym.sandbox import Limits, Sandbox
from raygym.sandbox.memcg import own_memory_cgroup
from tests.sandbox.hostile import MiB

BUDGET = Limits(cpu_seconds=5, wall_seconds=20.0, memory_bytes=288 * MiB, tmp_bytes=32 * MiB, file_bytes=512 * MiB)

FILL = r"""
import json, os
def fill(directory):
    written = 0
    try:
        for i in range(1000):
            with open(os.path.join(directory, f"fill{i}"), "wb") as fh:
                for _ in range(16):
                    fh.write(b"x" * (1 << 20))
                    fh.flush()
                    written += 1 << 20
    except OSError:
        pass
    return written
print(json.dumps({d: fill(d) for d in ("/dev/shm", "/tmp", "/dev", "/", "/var/tmp", "/usr", "/proc")}))
"""


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def test_writable_file_systems_share_one_sized_budget(backend):
    before = mem_available()
    with Sandbox(BUDGET, backend=backend) as box:
        result = box.run(FILL)
    assert result.exit_code == 0, result.stderr
    written = json.loads(result.stdout)
    assert sum(written.values()) <= BUDGET.tmp_bytes, written  # 400 MiB tried, all of it into tmpfs
    assert written["/tmp"] > 8 * MiB and written["/dev/shm"] > 2 * MiB  # the private dirs do work
    assert written["/dev"] == written["/"] == written["/usr"] == written["/proc"] == 0
    assert mem_available() > before - 1024 ** 3  # and the host has it back (a generous margin: shared machine)


def test_memory_outside_the_file_systems_is_refused(box):
    program = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {}
try:
    os.memfd_create("hoard")
    out["memfd"] = "created"
except OSError as exc:
    out["memfd"] = exc.errno
def call(name, *args):
    ctypes.set_errno(0)
    result = getattr(libc, name)(*args)
    return ctypes.get_errno() if result == -1 else "created"
out["shmget"] = call("shmget", 0, 64 << 20, 0o1600)
out["msgget"] = call("msgget", 0, 0o1600)
out["semget"] = call("semget", 0, 4, 0o1600)
out["mq_open"] = call("mq_open", b"/hoard", os.O_CREAT | os.O_RDWR, 0o600, None)
print(json.dumps(out))
"""
    result = box.run(program)
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {1}  # EPERM each


def test_processes_together_stay_within_the_budget(backend):
    limits = Limits(cpu_seconds=10, wall_seconds=20.0, memory_bytes=256 * MiB, tmp_bytes=32 * MiB, processes=16)
    hoard = r"""
import os, time
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray(150 << 20)  # well inside its address space: the cgroup must stop it
            for i in range(0, len(block), 4096):
                block[i] = 1
            open("/tmp/x%d" % os.getpid(), "wb").write(b"y" * (4 << 20))
            time.sleep(2)
        except (MemoryError, OSError):
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
"""
    before = mem_available()
    with Sandbox(limits, backend=backend) as box:
        if box.cgroup is None:
            pytest.skip(f"no memory cgroup here ({box.memory_bound}): each process is bounded on its own")
        result = box.run(hoard)
        peak = box.cgroup.peak_bytes()
    assert peak is not None and peak <= limits.memory_bytes, (peak, result)
    assert peak > 100 * MiB, (peak, result)  # 6 x 154 MiB tried together: the budget was really pressed
    assert mem_available() > before - 1024 ** 3


def test_the_machine_offers_a_cgroup_and_the_sandbox_uses_it(backend):
    mount = own_memory_cgroup()
    with Sandbox(BUDGET, backend=backend) as box:
        if mount is None or box.cgroup is None:
            pytest.skip(f"no memory cgroup we may create here ({box.memory_bound})")
        assert box.cgroup.limit_bytes() == BUDGET.memory_bytes
        assert box.cgroup.directory.parent == mount.directory and "cgroup" in box.memory_bound
        directory = box.cgroup.directory
    assert not directory.exists()  # removed when the sandbox closes


def test_limits_count_the_files_against_the_memory():
    limits = Limits(memory_bytes=288 * MiB, tmp_bytes=32 * MiB)
    assert limits.address_space_bytes == 256 * MiB and limits.shm_bytes + limits.private_tmp_bytes == 32 * MiB
    with pytest.raises(ConfigError, match="tmp_bytes"):
        Limits(memory_bytes=64 * MiB, tmp_bytes=48 * MiB)
    with pytest.raises(ConfigError, match="cpu_seconds"):
        Limits(cpu_seconds=0)
