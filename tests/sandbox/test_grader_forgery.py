"""The verdict cannot be forged from inside the sandbox: wrong code that attacks the grading in every way
we know scores 0 on every backend, and honest code of many shapes still scores 1.0.

The tests run in a separate grader process and only plain values cross from the candidate, so each
attack below is wrong code (its ``f`` never computes ``x + 1``) plus an attempt to make the grading
say otherwise: print verdicts, find the expected values or the tests in its own memory, patch
builtins, the harness or ``int``, walk frames, return objects that claim equality, write to the
channel, reach the grader through ``/proc``, ``ptrace`` or signals, exit early, flood or stall.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from raygym.sandbox import Limits, Sandbox, run_tests

TESTS = ["assert f(1) == 2", "assert f(41) == 42", "assert f(-5) == -4"]
SECRET = "expected-token-5c1d"  # an expected value that appears only in a test
SECRET_TEST = [f"assert f(1) == {SECRET!r}"]

FORGERIES = {
    "prints verdict lines": (
        "import sys\nfor i in range(3):\n    print('PASS', i); print(f'PASS {i}', file=sys.stderr)\n"
        "print('LOADED'); print('DONE')\ndef f(x):\n    return 0\n"),
    "replaces compile, exec and AssertionError": (
        "import builtins\nbuiltins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
        "builtins.exec = lambda *a, **k: None\nbuiltins.AssertionError = KeyError\ndef f(x):\n    return 0\n"),
    "walks frames and rewrites every test list it finds": (
        "import gc, sys\n"
        "frame = sys._getframe()\nwhile frame is not None:\n"
        "    for name, value in list(frame.f_locals.items()):\n"
        "        if isinstance(value, list) and value and all(isinstance(t, str) for t in value):\n"
        "            value[:] = ['pass'] * len(value)\n"
        "    frame = frame.f_back\n"
        "for obj in gc.get_objects():\n"
        "    if isinstance(obj, list) and obj and all(isinstance(t, str) and 'assert' in t for t in obj):\n"
        "        obj[:] = ['pass'] * len(obj)\n"
        "def f(x):\n    return 0\n"),
    "returns an object equal to everything": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    __hash__ = object.__hash__\n    def __bool__(self):\n        return True\n"
        "def f(x):\n    return Anything()\n"),
    "returns an int subclass that lies": (
        "class Lying(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return Lying(0)\n"),
    "patches int and str": (
        "import builtins\nclass Int(int):\n    def __eq__(self, other):\n        return True\n"
        "builtins.int = Int\nbuiltins.str = lambda *a: 'x'\nint.__eq__ = lambda *a: True\n"
        "def f(x):\n    return Int(0)\n"),
    "shadows the builtins the tests use": (
        "def abs(x):\n    return 0\ndef len(x):\n    return 0\ndef isinstance(*a):\n    return True\n"
        "def all(*a):\n    return True\ndef f(x):\n    return 10 ** 9\n"),
    "exits before the tests": "import os\nos._exit(0)\ndef f(x):\n    return x + 1\n",
    "raises SystemExit at load": "raise SystemExit(0)\n",
    "exits inside a test": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "kills itself inside a test": "import os, signal\ndef f(x):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "raises AssertionError-free exceptions the grader might count": (
        "class Passed(Exception):\n    pass\ndef f(x):\n    raise Passed('PASS 0')\n"),
    "writes forged frames to every descriptor": (
        "import os\nfrom raygym.sandbox import wire\n"
        "for fd in range(0, 256):\n    for message in (('hello', None), ('ok', 2), ('ok', 42), ('ok', -4)):\n"
        "        try:\n            wire.write_frame(fd, wire.dumps(message))\n        except OSError:\n            pass\n"
        "def f(x):\n    return 0\n"),
    "looks for the grader in /proc and traces, signals and steals from it": (
        "import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\nfound = []\n"
        "for pid in os.listdir('/proc'):\n    if not pid.isdigit():\n        continue\n"
        "    try:\n        found.append(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
        "        for fd in os.listdir(f'/proc/{pid}/fd'):\n"
        "            try:\n                os.write(os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY), b'PASS 0\\nDONE\\n')\n"
        "            except OSError:\n                pass\n    except OSError:\n        pass\n"
        "    libc.ptrace(16, int(pid), 0, 0)\n"
        "for pid in range(1, 4096):\n    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
        "        try:\n            os.kill(pid, sig)\n        except OSError:\n            pass\n"
        "for target in (0, -1, os.getppid()):\n    try:\n        os.kill(target, signal.SIGTERM)\n"
        "    except OSError:\n        pass\n"
        "def f(x):\n    return 0\n"),
    "stalls forever inside a test": "def f(x):\n    while True:\n        pass\n",
    "sleeps forever at load": "import time\ntime.sleep(3600)\n",
    "answers with more than the grader reads": "def f(x):\n    return 'x' * (64 * 1024 * 1024)\n",
    "answers with nesting deeper than the grader decodes": (
        "def f(x):\n    a = []\n    for _ in range(100000):\n        a = [a]\n    return a\n"),
    "answers with a function that returns the right value": "def f(x):\n    return lambda: x + 1\n",
    "floods its output": "import sys\nwhile True:\n    sys.stdout.write('PASS 0\\n' * 4096)\n",
    "forks a child that keeps the channel": (
        "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\ndef f(x):\n    return 0\n"),
}


def test_answers_a_test_prints_are_not_verdicts(box):
    # A test that prints the candidate's answer (debugging output in a dataset) must not let the answer
    # speak for the grader: every verdict line the grader could write, in the answer.
    forged = "LOADED\n" + "".join(f"PASS {i}\n" for i in range(4)) + "DONE\n"
    code = f"def f(x):\n    return {forged!r}\n"
    report = run_tests(box, code, ["print(f(1))\nassert f(1) == 2", "import sys\nprint(f(1), file=sys.stderr)",
                                   "print(f(1), flush=True)\nassert False"])
    assert (report.passed, report.failed) == (1, 2), report  # only the test with no assertion passed


def test_a_test_that_evaluates_an_answer_stays_in_the_graders_sandbox(box):
    # A dataset's test that runs the candidate's answer as code hands the candidate the grader's
    # interpreter: that interpreter is sandboxed too, so the host stays out of reach.
    target = Path(f"/tmp/raygym-grader-escape-{os.getpid()}-{time.monotonic_ns()}")
    answer = f"open({str(target)!r}, 'w').write('owned') and __import__('os').listdir('/')"
    report = run_tests(box, f"def f(x):\n    return {answer!r}\n", ["assert 'home' in eval(f(1))"])
    assert report.passed == 0 and report.loaded and not target.exists(), report


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgery_scores_zero(box, name):
    report = run_tests(box, FORGERIES[name], TESTS)
    assert report.passed == 0, (name, report)
    assert report.grader_error == "" or report.timed_out, report  # the grader itself never broke


LIAR = (
    "class Liar:\n    def __eq__(self, other):\n        return True\n    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__\n"
    "    def __contains__(self, item):\n        return True\n    def __hash__(self):\n        return 0\n"
    "    def __len__(self):\n        return 3\n    def __iter__(self):\n        return iter([9, 9, 9])\n"
    "    def __index__(self):\n        return 2\n    def __bool__(self):\n        return False\n"
    "def f(x):\n    return Liar()\ndef g(x):\n    return [Liar(), Liar()]\n"
    "class LyingDict(dict):\n    def __eq__(self, other):\n        return True\n    def items(self):\n"
    "        return [('a', 1)]\n    def keys(self):\n        return ['a']\n    def __iter__(self):\n        return iter(['a'])\n"
    "    def __getitem__(self, key):\n        return 1\n    def __len__(self):\n        return 1\n"
    "class LyingList(list):\n    def __eq__(self, other):\n        return True\n    def __iter__(self):\n"
    "        return iter([1, 2])\n    def __len__(self):\n        return 2\n"
    "class LyingInt(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
    "def h(x):\n    return LyingDict(b=2)\ndef k(x):\n    return LyingList([9])\ndef m(x):\n    return LyingInt(0)\n"
)
COMPARISONS = ["assert f(1) == 2", "assert not (f(1) != 2)", "assert 2 == f(1)", "assert 3 in f(1)",
               "assert f(1) >= 2 and f(1) <= 2", "assert g(1) == [1, 2]", "assert [1, 2] == g(1)",
               "assert list(f(1)) == [1, 2, 3]", "assert {'k': f(1)} == {'k': 2}", "assert (f(1), 1) == (2, 1)",
               "assert f(1) in [2]", "assert [0, 0, 7][f(1)] == 7", "assert h(1) == {'a': 1}",
               "assert h(1)['a'] == 1", "assert k(1) == [1, 2]", "assert len(k(1)) == 2", "assert m(1) == 2",
               "assert m(1) in {2}"]


def test_candidate_objects_cannot_answer_comparisons(box):
    # Objects that claim equality, containment and order with everything: every comparison runs in the
    # grader, on its own values, and a handle equals only itself (the last one indexes with __index__).
    report = run_tests(box, LIAR, COMPARISONS)
    assert (report.passed, report.loaded) == (0, True), report


SCAN = r"""
import gc, re
PATTERN = re.compile('expected-' + 'token-' + '[0-9a-f]{4}')
def search():
    for obj in gc.get_objects():
        items = list(obj.items()) if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else [obj]
        for item in items:
            for text in (item if isinstance(item, tuple) else (item,)):
                if isinstance(text, str) and PATTERN.search(text):
                    return PATTERN.search(text).group(0)
    raw = re.compile(PATTERN.pattern.encode())
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            fields = line.split()
            if 'r' not in fields[1]:
                continue
            start, end = (int(v, 16) for v in fields[0].split('-'))
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except (OSError, ValueError, OverflowError, MemoryError):
                continue
            found = raw.search(chunk)
            if found:
                return found.group(0).decode()
    return None
def f(x):
    return search()
"""


def test_the_expected_values_never_enter_the_candidate(box):
    # The candidate searches all it can read (every object, its whole memory) for the test's expected
    # value and returns it when found: it finds nothing, because the tests stay in the grader.
    report = run_tests(box, SCAN, SECRET_TEST)
    assert report.passed == 0 and report.loaded and report.grader_error == "", report
    # the same search does find the value when the candidate holds it: the scan works
    assert run_tests(box, f"planted = {SECRET!r}\n" + SCAN, SECRET_TEST).passed == 1


HONEST = {
    "a plain function": ("def f(x):\n    return x + 1\n", TESTS),
    "a lambda through a prefix": ("f=lambda x:x+1", TESTS),
    "builtins in the tests": (
        "def f(n):\n    return list(range(n))\n",
        ["assert len(f(3)) == 3", "assert sorted(f(4), reverse=True)[0] == 3", "assert abs(sum(f(5)) - 10) <= 0",
         "assert isinstance(f(2), list) and all(isinstance(v, int) for v in f(2))"]),
    "a shared helper and a loop in the tests": (
        "def square(x):\n    return x * x\n",
        ["cases = {2: 4, 3: 9, -1: 1}", "assert all(square(k) == v for k, v in cases.items())",
         "assert [square(i) for i in range(4)] == [0, 1, 4, 9]"]),
    "plain values of every kind": (
        "def echo(v):\n    return v\n",
        ["assert echo(None) is None and echo(True) is True", "assert echo(2 ** 100) == 2 ** 100",
         "assert echo(0.5) == 0.5 and echo(1j) == 1j", "assert echo('é✓') == 'é✓' and echo(b'\\x00') == b'\\x00'",
         "assert echo({'a': [1, (2, 3)], 4: {5}}) == {'a': [1, (2, 3)], 4: {5}}",
         "assert echo(frozenset({1})) == frozenset({1}) and echo(()) == ()"]),
    "classes, methods and attributes": (
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, v):\n"
        "        self.items.append(v)\n    def pop(self):\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n",
        ["s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s) == 1 and s.items == [1]"]),
    "generators and iteration": (
        "def count(n):\n    yield from range(n)\nclass Bag:\n    def __init__(self):\n        self.v = [3, 4]\n"
        "    def __iter__(self):\n        return iter(self.v)\n    def __contains__(self, x):\n        return x in self.v\n",
        ["assert list(count(3)) == [0, 1, 2]", "g = count(2)\nassert next(g) == 0 and next(g) == 1",
         "assert sum(Bag()) == 7 and 3 in Bag() and 5 not in Bag()"]),
    "expected exceptions": (
        "def safe_div(a, b):\n    if b == 0:\n        raise ValueError('b is zero')\n    return a / b\n",
        ["try:\n    safe_div(1, 0)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
         "assert safe_div(6, b=3) == 2.0"]),
    "in-place mutation of arguments": (
        "def sort_in_place(xs):\n    xs.sort()\ndef add_key(d, k):\n    d[k] = True\n",
        ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]", "d = {}\nadd_key(d, 'a')\nassert d == {'a': True}"]),
    "module constants, recursion and str()": (
        "LIMIT = 10\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "class P:\n    def __str__(self):\n        return 'P!'\n",
        ["assert LIMIT == 10", "assert fib(15) == 610", "assert str(P()) == 'P!'"]),
    "subclasses of plain types": (
        "from collections import Counter, OrderedDict, defaultdict, namedtuple\nPoint = namedtuple('Point', 'x y')\n"
        "def counts(s):\n    return Counter(s)\ndef groups(words):\n    d = defaultdict(list)\n    for w in words:\n"
        "        d[w[0]].append(w)\n    return d\ndef origin():\n    return Point(0, 0)\ndef evens(n):\n"
        "    return range(0, n, 2)\ndef ordered():\n    return OrderedDict(b=1, a=2)\n",
        ["assert counts('aab') == {'a': 2, 'b': 1}", "assert groups(['ab', 'ac', 'b']) == {'a': ['ab', 'ac'], 'b': ['b']}",
         "assert origin() == (0, 0)", "assert evens(5) == range(0, 5, 2) and list(evens(5)) == [0, 2, 4]",
         "assert list(ordered()) == ['b', 'a']"]),
    "a main block and prints": (
        "print('hello')\ndef f(x):\n    return x + 1\nif __name__ == '__main__':\n    raise SystemExit(3)\n", TESTS),
}


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_code_scores_one(box, name):
    code, tests = HONEST[name]
    report = run_tests(box, code, tests)
    assert (report.passed, report.total, report.loaded, report.grader_error) == (len(tests), len(tests), True, ""), report


def test_modules_go_as_source_where_the_sandbox_reads_other_bytecode(box, monkeypatch):
    from raygym.sandbox import programs

    monkeypatch.setattr(programs, "reads_our_bytecode", lambda python: False)
    assert b"def dumps(" in programs.stdin_for(("wire",), b"", programs.reads_our_bytecode("python3"))
    report = run_tests(box, *HONEST["classes, methods and attributes"])
    assert (report.passed, report.total) == (1, 1)


def test_partial_credit_and_what_the_grader_reports(box):
    report = run_tests(box, "def f(x):\n    if x < 0:\n        raise KeyError(x)\n    return 2\n", TESTS)
    assert (report.passed, report.failed, report.loaded, report.timed_out) == (1, 1, True, False)  # f(-5) raised
    broken = run_tests(box, "def f(x)\n    return x", TESTS)
    assert (broken.passed, broken.loaded, broken.load_error) == (0, False, "SyntaxError")


def test_a_run_that_times_out_keeps_the_verdicts_before_it(backend):
    limits = Limits(cpu_seconds=10, wall_seconds=3.0, memory_bytes=256 * 1024 * 1024)
    code = "import time\ndef f(x):\n    if x == 41:\n        time.sleep(60)\n    return x + 1\n"
    with Sandbox(limits, backend=backend) as box:
        report = run_tests(box, code, TESTS)
    assert (report.passed, report.timed_out) == (1, True)
