"""A memory cgroup for one sandbox, where the machine lets us make one: a child of this process's own
memory cgroup (cgroup v1's ``memory`` hierarchy, or a v2 cgroup whose ``memory`` controller is
delegated to us) whose limit bounds everything the sandboxed processes hold together: their
anonymous memory, every page of the tmpfs files they write, shared memory, page tables.

Without one (an ordinary user on v1, or v2 without delegation), a sandbox's memory is bounded per
process (``RLIMIT_AS``) and its files by the sizes of its tmpfs mounts: see
:class:`raygym.sandbox.isolation.Limits`.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupMount:
    version: int  # 1 or 2
    directory: Path  # this process's own memory cgroup


def own_memory_cgroup() -> CgroupMount | None:
    """Where this process's memory cgroup lives in the file system (v1 ``memory`` first, then v2)."""
    try:
        membership = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths_v1 = {}
    path_v2 = None
    for line in membership:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            path_v2 = path
        for controller in controllers.split(","):
            paths_v1[controller] = path
    for line in mounts:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup" and "memory" in options and "memory" in paths_v1:
            directory = _inside(mount_point, root, paths_v1["memory"])
            if directory is not None:
                return CgroupMount(1, directory)
    for line in mounts:
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and tail and tail[0] == "cgroup2" and path_v2 is not None:
            directory = _inside(fields[4], fields[3], path_v2)
            if directory is not None and "memory" in _read(directory / "cgroup.controllers").split():
                return CgroupMount(2, directory)
    return None


def _inside(mount_point: str, mount_root: str, path: str) -> Path | None:
    if not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        return None
    directory = Path(mount_point) / path[len(mount_root):].lstrip("/")
    return directory if directory.is_dir() else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class MemoryCgroup:
    """One sandbox's memory cgroup: ``limit`` it, ``add`` a process before it starts the program,
    ``peak_bytes`` it used, ``remove`` it when the sandbox closes."""

    def __init__(self, mount: CgroupMount, directory: Path) -> None:
        self.version, self.directory = mount.version, directory

    @property
    def description(self) -> str:
        return f"memory cgroup v{self.version} ({self.directory})"

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | None:
        """The cgroup ``name`` under this process's own, limited to ``limit_bytes``; None where the
        machine offers none we may create (not root on v1, no delegated v2 memory controller)."""
        mount = own_memory_cgroup()
        if mount is None:
            return None
        if mount.version == 2 and "memory" not in _read(mount.directory / "cgroup.subtree_control").split():
            try:
                (mount.directory / "cgroup.subtree_control").write_text("+memory")
            except OSError:  # processes in our own cgroup (v2's no-internal-processes rule), or no right
                return None
        _remove_stale(mount.directory)
        directory = mount.directory / name
        try:
            directory.mkdir(exist_ok=True)
        except OSError:
            return None
        group = cls(mount, directory)
        try:
            group.limit(limit_bytes)
        except OSError:
            group.remove()
            return None
        return group

    def limit(self, limit_bytes: int) -> None:
        if self.version == 1:
            memsw = self.directory / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # swap too (memsw >= limit at all times: open it first, close it last)
                memsw.write_text("-1")
            (self.directory / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
            self._reset_peak()
        else:
            (self.directory / "memory.max").write_text(str(limit_bytes))
            if (self.directory / "memory.swap.max").exists():
                (self.directory / "memory.swap.max").write_text("0")

    def _reset_peak(self) -> None:
        try:
            (self.directory / "memory.max_usage_in_bytes").write_text("0")
        except OSError:
            pass

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and what it starts afterwards) into the cgroup."""
        (self.directory / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.directory / "cgroup.procs").split()]

    def peak_bytes(self) -> int | None:
        """The most it held at once since the limit was last set (v1), or ever (v2 ``memory.peak``)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        text = _read(self.directory / name).strip()
        return int(text) if text.isdigit() else None

    def limit_bytes(self) -> int:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return int(_read(self.directory / name).strip())

    def remove(self, wait_seconds: float = 2.0) -> None:
        """Delete the cgroup (idempotent); its processes must be dead (it waits ``wait_seconds`` for the
        kernel to finish their exit)."""
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                self.directory.rmdir()
                return
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
            time.sleep(0.01)

    def __repr__(self) -> str:
        return f"MemoryCgroup({self.description})"


_created = itertools.count()
PREFIX = "raygym-sandbox-"


def _remove_stale(parent: Path) -> None:
    """Remove the empty cgroups that sandboxes of dead processes left (a killed Ray actor never closes)."""
    for directory in parent.glob(PREFIX + "*"):
        fields = directory.name[len(PREFIX):].split("-")
        if len(fields) != 3 or not fields[1].isdigit() or int(fields[1]) == os.getpid():
            continue
        try:
            os.kill(int(fields[1]), 0)
            continue  # its process lives
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            directory.rmdir()
        except OSError:  # still holds processes
            pass


def cgroup_name(uid: int) -> str:
    """A name no other sandbox uses: its uid, this process, a counter."""
    return f"{PREFIX}{uid}-{os.getpid()}-{next(_created)}"
