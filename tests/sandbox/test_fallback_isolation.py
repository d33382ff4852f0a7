"""Isolation on every backend, the unshare fallback included (forced by name on this machine): the
escapes that worked against the former fallback fail, an ordinary user's files stay out of reach when
the sandbox runs as that user, and a machine that cannot isolate gets a refusal naming bubblewrap
unless the caller opts into the weak mode by its flag."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import raygym
from raygym.errors import ConfigError
from raygym.sandbox import Limits, Sandbox, programs, run_tests
from raygym.sandbox.isolation import python_executable, stage_call
from raygym.sandbox.stage import FAILED
from tests.sandbox.hostile import FAST, hostile, working_backends

REPO = Path(raygym.__file__).resolve().parents[1]
BACKENDS = working_backends()
ESCAPES = r"""
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def attempt(escape):
    try:
        return "worked" if escape() else "refused"
    except Exception as exc:
        return type(exc).__name__
def write(path):
    with open(path, "w") as fh:
        fh.write("owned")
    return True
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(b"leak")
    return True
def capabilities_left():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return any(int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"))
results = {
    "unmount the private /tmp": attempt(lambda: libc.umount2(b"/tmp", 2) == 0),
    "/run/lock": attempt(lambda: write("/run/lock/" + TAG)),
    "world-writable dir": attempt(lambda: write(OPEN_DIR + "/x")),
    "world-readable secret": attempt(lambda: "secret" in open(SECRET_FILE).read()),
    "/etc/passwd": attempt(lambda: "root" in open("/etc/passwd").read()),
    "host unix socket": attempt(lambda: connect(SOCKET_PATH)),
    "64 GiB tmpfs": attempt(lambda: libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=64g") == 0),
    "new user and mount namespace": attempt(lambda: libc.unshare(0x10000000 | 0x00020000) == 0),
    "chroot": attempt(lambda: libc.chroot(b"/") == 0),
    "capabilities left": attempt(capabilities_left),
}
write(HOST_TMP_FILE)  # its own /tmp: must not show on the host
worked = any(outcome == "worked" for outcome in results.values())
"""
REPORT = """print(json.dumps({"results": results, "root": sorted(os.listdir("/")), "pid": os.getpid(),
                  "seccomp": open("/proc/self/status").read().split("Seccomp:")[1].split()[0]}))
"""


@pytest.fixture
def host_targets():
    """World-reachable places on the host: a 0777 directory, a 0644 secret, a 0777 unix socket whose
    server records what reaches it."""
    tag = f"raygym-escape-{os.getpid()}-{time.monotonic_ns()}"
    open_dir = Path(tempfile.mkdtemp(prefix="raygym-open-", dir="/var/tmp"))
    open_dir.chmod(0o777)
    secret = open_dir.with_name(open_dir.name + "-secret")
    secret.write_text("the host's secret")
    secret.chmod(0o644)
    socket_path = f"/tmp/{tag}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_path)
    os.chmod(socket_path, 0o777)
    server.listen(4)
    server.settimeout(0.1)
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            received.append(conn.recv(64))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    targets = {"TAG": tag, "OPEN_DIR": str(open_dir), "SECRET_FILE": str(secret), "SOCKET_PATH": socket_path,
               "HOST_TMP_FILE": f"/tmp/{tag}"}
    yield targets, received
    stop.set()
    thread.join(2)
    server.close()
    for path in (socket_path, f"/tmp/{tag}", f"/run/lock/{tag}", str(secret)):
        Path(path).unlink(missing_ok=True)
    shutil.rmtree(open_dir, ignore_errors=True)


def test_host_files_sockets_and_mounts_stay_out_of_reach(box, host_targets):
    targets, received = host_targets
    preamble = "".join(f"{name} = {value!r}\n" for name, value in targets.items())
    result = box.run(preamble + ESCAPES + REPORT)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert set(seen["results"].values()) <= {"refused", "FileNotFoundError", "PermissionError", "OSError"}, seen
    assert seen["root"] == ["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr"]
    assert (seen["pid"], seen["seccomp"]) == (1, "2")  # its own PID namespace, the filter on
    assert received == [] and os.listdir(targets["OPEN_DIR"]) == []
    assert not Path(targets["HOST_TMP_FILE"]).exists() and not Path("/run/lock", targets["TAG"]).exists()
    # and the same attempts in a graded candidate score nothing
    assert run_tests(box, preamble + ESCAPES + "def f(x):\n    return x + 1 if worked else -1\n",
                     ["assert f(1) == 2"]).passed == 0


USER = "raygym-sbx"
AS_USER = r"""
import json, os, sys, types
repo, home, backends = sys.argv[1], sys.argv[2], sys.argv[3:]
package = types.ModuleType("raygym")  # the system python lacks raygym's config dependencies: skip its __init__
package.__path__ = [repo + "/raygym"]
sys.modules["raygym"] = package
from raygym.sandbox import Limits, Sandbox, run_tests
attack = f'''
import os
worked = False
for path in ({home!r} + "/secret.txt", "/proc/1/root" + {home!r} + "/secret.txt"):
    try:
        worked = worked or "mine" in open(path).read()
    except OSError:
        pass
for path in ({home!r} + "/owned", "/tmp/../" + {home!r} + "/owned"):
    try:
        open(path, "w").write("x")
        worked = True
    except OSError:
        pass
def f(x):
    return x + 1 if worked else -1
'''
out = {}
for backend in backends:
    with Sandbox(Limits(cpu_seconds=2, wall_seconds=8.0), backend=backend, allow_weak_isolation=backend == "weak") as box:
        out[backend] = {"attack": run_tests(box, attack, ["assert f(1) == 2"]).passed,
                        "honest": run_tests(box, "def f(x):\n    return x + 1\n", ["assert f(1) == 2"]).passed,
                        "forgery": run_tests(box, "print('PASS 0')\ndef f(x):\n    return 0\n", ["assert f(1) == 2"]).passed,
                        "memory_bound": box.memory_bound, "uid": box.uid}
    out[backend]["home_written"] = os.path.exists(home + "/owned")
print(json.dumps(out))
"""


def ordinary_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
        return pwd.getpwnam(USER)


def test_an_ordinary_users_files_stay_out_of_reach():
    if os.geteuid() != 0:
        reason = "needs root to create an ordinary user and run the sandbox as that user (runuser)"
        print(reason)
        pytest.skip(reason)
    if not BACKENDS:
        pytest.skip("no sandbox backend works here")
    user = ordinary_user()
    home = Path(user.pw_dir)
    secret = home / "secret.txt"
    secret.write_text("mine")
    os.chown(secret, user.pw_uid, user.pw_gid)
    secret.chmod(0o600)
    (home / "owned").unlink(missing_ok=True)
    script_dir = Path(tempfile.mkdtemp(prefix="raygym-as-user-"))
    try:
        script_dir.chmod(0o755)
        script = script_dir / "as_user.py"
        script.write_text(AS_USER)
        script.chmod(0o644)
        done = subprocess.run(["runuser", "-u", USER, "--", python_executable(), str(script), str(REPO), str(home),
                               *BACKENDS, "weak"], capture_output=True, text=True, timeout=240, cwd="/")
    finally:
        shutil.rmtree(script_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for backend in BACKENDS:
        seen = results[backend]
        assert (seen["attack"], seen["honest"], seen["forgery"], seen["uid"], seen["home_written"]) == \
            (0, 1, 0, user.pw_uid, False), (backend, seen)
        assert "no memory cgroup" in seen["memory_bound"]  # an ordinary user may not create one here
    # the control: without namespaces (the weak mode) the same attack does reach the user's files
    assert (results["weak"]["attack"], results["weak"]["forgery"], results["weak"]["home_written"]) == (1, 0, True)
    assert secret.read_text() == "mine"
    (home / "owned").unlink()


def test_a_machine_that_cannot_isolate_gets_a_refusal_naming_bubblewrap(tmp_path):
    tools = tmp_path / "bin"  # a PATH with neither bwrap nor unshare
    tools.mkdir()
    (tools / "prlimit").symlink_to(shutil.which("prlimit") or "/usr/bin/prlimit")
    probe = ("import sys\nfrom raygym.sandbox import Sandbox, SandboxUnavailable\n"
             "try:\n    Sandbox()\nexcept SandboxUnavailable as exc:\n    print('refused:', exc)\n"
             "with Sandbox(allow_weak_isolation=True) as box:\n    print('weak:', box.backend)\n")
    env = {**os.environ, "PATH": str(tools)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    refused, weak = done.stdout.splitlines()
    assert refused.startswith("refused:") and "bubblewrap" in refused and "allow_weak_isolation=True" in refused
    assert weak == "weak: weak"


def test_the_weak_mode_needs_its_flag_and_still_grades_out_of_reach():
    with pytest.raises(ConfigError, match="allow_weak_isolation"):
        Sandbox(backend="weak")
    with Sandbox(FAST, backend="weak", allow_weak_isolation=True) as box:
        assert run_tests(box, "def f(x):\n    return x + 1\n", ["assert f(1) == 2"]).passed == 1
        frames = ("import gc\nfor o in gc.get_objects():\n    if isinstance(o, list) and o and "
                  "all(isinstance(t, str) and 'assert' in t for t in o):\n        o[:] = ['pass']\n")
        assert run_tests(box, frames + "def f(x):\n    return 0\n", ["assert f(1) == 2"]).passed == 0
        sockets = "import socket\ntry:\n    socket.socket(socket.AF_UNIX)\n    worked = True\nexcept OSError:\n    pass\n"
        assert run_tests(box, hostile(sockets), ["assert f(1) == 2"]).passed == 0  # no socket at all


def test_a_stage_that_cannot_isolate_stops_the_run():
    # The fallback's stage run without its namespaces (no right to mount): it must end the process before
    # the program runs, never run it unconfined.
    limits = Limits()
    bootstrap, modules = programs.run_program(stage_call("unshare", limits))
    python = python_executable()
    argv = [python, "-I", "-S", "-c", bootstrap]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    done = subprocess.run(argv, input=programs.stdin_for(modules, b"print('ran unconfined')",
                                                         programs.reads_our_bytecode(python)),
                          capture_output=True, timeout=60, cwd="/")
    assert done.returncode == FAILED and b"ran unconfined" not in done.stdout
    assert b"cannot isolate" in done.stderr
