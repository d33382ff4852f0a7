"""Hostile generated code in the sandbox: each attack scores 0 and nothing reaches the host.

Every hostile program defines ``f`` so that it is RIGHT only if its attack succeeded
(``def f(x): return x + 1 if attack_worked else -1``; the test is ``assert f(1) == 2``), so a score of
0 means the attack failed, and the host is checked directly afterwards. Run for each isolation
backend that works here (bubblewrap, and unshare as the fallback; see conftest.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raygym.sandbox import Limits, Sandbox, run_tests
from raygym.sandbox.process import processes_of
from tests.sandbox.hostile import FAST, hostile

TEST = ["assert f(1) == 2"]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def test_honest_code_scores_and_partial_credit(box):
    full = run_tests(box, "def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(5) == 6"])
    assert (full.passed, full.total, full.loaded) == (2, 2, True)
    half = run_tests(box, "f = lambda x: 2", ["assert f(1) == 2", "assert f(5) == 6"])
    assert half.passed == 1
    fake = run_tests(box, "print('PASS 0')\nprint('x PASS 0')\nf = lambda x: 0", ["assert f(1) == 2"])
    assert fake.passed == 0  # what the candidate prints is not a verdict


def test_infinite_loop_is_stopped(box):
    started = time.monotonic()
    report = run_tests(box, "def f(x):\n    while True:\n        pass\n", TEST)
    assert report.passed == 0 and report.exit_code != 0
    assert time.monotonic() - started < FAST.wall_seconds + 3


def test_sleeping_forever_hits_the_wall_clock(box):
    report = run_tests(box, "import time\ntime.sleep(3600)\nf = lambda x: x + 1", TEST)
    assert report.passed == 0 and report.timed_out


def test_fork_bomb_is_contained(box):
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    report = run_tests(box, hostile(bomb + "worked = True"), TEST)
    assert report.passed == 0
    assert processes_of(box.uid) == []  # every process it forked is gone


def test_memory_hog_is_refused_and_memory_comes_back(box):
    before = mem_available()
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))\n"
    report = run_tests(box, hostile(hog + "worked = True"), TEST)
    big = run_tests(box, hostile("data = bytearray(8 * 1024 ** 3)\nworked = True"), TEST)
    assert report.passed == 0 and big.passed == 0
    assert report.load_error == big.load_error == "MemoryError"  # stopped by the address-space limit
    assert processes_of(box.uid) == []  # so the kernel has its memory back
    assert mem_available() > before - 1024 ** 3  # the machine is shared: a generous margin for others


def test_no_network_reaches_the_host(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn.recv(100))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    attack = (f"import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
              "    s.sendall(b'leak')\n    worked = True\nexcept OSError:\n    pass\n")
    try:
        report = run_tests(box, hostile(attack), TEST)
    finally:
        stop.set()
        thread.join(2)
        server.close()
    assert report.passed == 0 and report.loaded
    assert accepted == []


def test_writing_outside_its_directory_fails(box, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # even a world-writable host directory stays out of reach
    tag = f"raygym-escape-{os.getpid()}-{time.monotonic_ns()}"
    targets = [open_dir / "x", Path("/tmp") / tag, Path("/var/tmp") / tag, Path("/dev/shm") / tag,
               Path(__file__).parent / tag, Path.home() / tag]
    # /tmp, /var/tmp and /dev/shm are the sandbox's own private ones: writing there is allowed and must not
    # show on the host; the host directories must refuse the write.
    private = [str(t) for t in targets[1:4]]
    host = [str(t) for t in (targets[0], *targets[4:])]
    attack = (f"for p in {private!r}:\n    try:\n        open(p, 'w').write('owned')\n    except OSError:\n"
              f"        pass\nfor p in {host!r}:\n    try:\n        open(p, 'w').write('owned')\n"
              "        worked = True\n    except OSError:\n        pass\n")
    report = run_tests(box, hostile(attack), TEST)
    assert report.passed == 0 and report.loaded
    assert [t for t in targets if t.exists()] == []


def secret_written(uid: int, secret: str) -> bool:
    """Whether a running process of ``uid`` sees ``secret`` in its private /tmp/secret.txt."""
    for pid in processes_of(uid):
        try:
            if secret in Path(f"/proc/{pid}/root/tmp/secret.txt").read_text():
                return True
        except OSError:  # not this process's file, or the process just ended
            continue
    return False


def test_one_sandbox_cannot_read_anothers_files(box):
    secret = f"secret-{time.monotonic_ns()}"
    slow = Limits(cpu_seconds=2, wall_seconds=15.0, memory_bytes=256 * 1024 * 1024, processes=16)
    with Sandbox(slow, backend=box.backend) as other:
        writer_code = (f"import time\nopen('/tmp/secret.txt', 'w').write({secret!r})\n"
                       "time.sleep(6)\nf = lambda x: x + 1")
        writer = threading.Thread(target=run_tests, args=(other, writer_code, TEST))
        writer.start()
        deadline = time.monotonic() + 30
        while not secret_written(other.uid, secret):  # read from the host through /proc/<pid>/root
            assert time.monotonic() < deadline, "the writer never wrote its secret"
            time.sleep(0.05)
        attack = (
            "import os\nfound = []\n"
            "for root in ['/tmp', '/var/tmp', '/dev/shm', '/proc']:\n"
            "    for dirpath, dirs, files in os.walk(root):\n"
            "        if dirpath.count('/') > 5:\n            dirs[:] = []\n"
            "        for name in files:\n"
            "            try:\n"
            f"                if {secret!r} in open(os.path.join(dirpath, name), errors='ignore').read(4096):\n"
            "                    found.append(name)\n"
            "            except Exception:\n                pass\n"
            "worked = bool(found)\n"
        )
        report = run_tests(box, hostile(attack), TEST)
        overlapped = bool(processes_of(other.uid))  # the writer was still running while the reader looked
        writer.join()
    assert report.passed == 0 and report.loaded
    assert overlapped


def test_killing_its_parent_or_host_processes_fails(box):
    sentinel = subprocess.Popen(["sleep", "60"])  # a host process the code knows the pid of
    # The host pids are not even visible from inside (their own PID namespace), so the calls fail; the
    # parent and -1 (every process it may signal) reach only the sandbox's own processes.
    attack = (
        "import os, signal\nhits = 0\n"
        f"for pid in ({os.getpid()}, {sentinel.pid}):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n        hits += 1\n    except OSError:\n        pass\n"
        "for pid in (os.getppid(), -1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
        "worked = hits == 2\n"
    )
    try:
        report = run_tests(box, hostile(attack), TEST)
        assert report.passed == 0
        assert sentinel.poll() is None and os.getppid() > 1  # the host processes live
        again = run_tests(box, "f = lambda x: x + 1", TEST)  # and the sandbox still works
        assert again.passed == 1
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()


def test_one_call_helpers_score_honest_and_hostile_code():
    from raygym.sandbox import run_code, score_code

    assert score_code("def f(x):\n    return x + 1\n", ["assert f(1) == 2", "assert f(2) == 4"], FAST) == 0.5
    assert score_code("import os\nos.system('echo hi > /tmp/x')\nwhile True:\n    pass\n", TEST, FAST) == 0.0
    result = run_code("import sys\nprint('out')\nsys.exit(3)", FAST)
    assert (result.exit_code, result.stdout, result.timed_out) == (3, "out\n", False)


def test_output_flood_is_capped(box):
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    report = run_tests(box, hostile(flood + "worked = True"), TEST)
    assert report.passed == 0
    result = box.run(flood)
    assert len(result.stdout) <= FAST.output_bytes and result.exit_code != 0  # killed by a limit, output cut


HOST = """
import sys
from raygym.sandbox import Limits, Sandbox
box = Sandbox(Limits(cpu_seconds=5, wall_seconds=120.0), backend=sys.argv[1])
print(box.uid, box.cgroup.directory if box.cgroup else "-", flush=True)
box.run("import time\\ntime.sleep(120)")
"""


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_host_that_dies_mid_run_takes_the_run_with_it(backend):
    if os.geteuid() != 0:
        reason = "needs root: the run's processes are found by their sandbox uid"
        print(reason)
        pytest.skip(reason)
    repo = Path(__file__).resolve().parents[2]
    host = subprocess.Popen([sys.executable, "-c", HOST, backend], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        uid_text, cgroup = host.stdout.readline().split()
        uid = int(uid_text)
        assert wait_for(lambda: processes_of(uid), 30), "the run never started"
    finally:
        host.kill()  # SIGKILL: the host has no chance to clean up
        host.wait()
    assert wait_for(lambda: not processes_of(uid), 10), processes_of(uid)  # the sleeper died with its host
    if cgroup != "-":
        with Sandbox(FAST, backend=backend):  # the next sandbox removes the cgroup the dead host left
            assert not Path(cgroup).exists()
