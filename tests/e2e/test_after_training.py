"""After training, end to end on CPU: two short `raygym train` runs of the tiny preset with eval on, then

- `raygym eval RUN` on the final checkpoint reproduces the run's last eval exactly (same seed);
- `raygym serve RUN` answers the `openai` client (models, completions, chat, streaming), refuses requests
  without the key, and leaves no engine process behind after Ctrl-C;
- `raygym report A B` renders in headless Chromium without console errors, every section drawn, and a
  screenshot is written under the test's temp dir.

Every command runs as a subprocess with its own local Ray (its own RAY_TMPDIR); nothing else is touched.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "e2e-serve-key-9b1f0c7e5a"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync"]


def _env(**extra: str) -> tuple[dict[str, str], str]:
    ray_tmp = tempfile.mkdtemp(prefix="rga-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "COLUMNS": "160",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)  # each command starts its own local Ray, like a user's
    env.pop("RAYGYM_SERVE_API_KEY", None)
    return {**env, **extra}, ray_tmp


def _raygym(*args: str, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    env, ray_tmp = _env(**extra_env)
    try:
        return subprocess.run([sys.executable, "-m", "raygym", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of `raygym train` (the tiny preset; the second with a larger lr)."""
    from raygym.builtin import next_digit_rows

    root = tmp_path_factory.mktemp("after-training")
    data = root / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in next_digit_rows(48, seed=5)))
    common = ["train", "--num-rollout", "2", "--eval-interval", "2", "--save-interval", "2",
              "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
              "--capture-trace", "--eval-prompt-data", json.dumps({"digits": str(data)})]
    dirs = [root / "run-a", root / "run-b"]
    for out, extra in zip(dirs, ([], ["--lr", "4e-3"]), strict=True):  # one at a time: 2 cores, 2 Rays is too many
        done = _raygym(*common, *extra, "--output-dir", str(out), timeout=400)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return dirs


def _last_eval(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert evals and evals[-1]["step"] == rows[-1]["step"] == 1, "the run's last step must carry its last eval"
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")}


def test_eval_reproduces_the_runs_last_eval(runs):
    run = runs[0]
    done = _raygym("eval", str(run), timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = json.loads((run / "eval" / "iter_0000001" / "metrics.json").read_text())
    expected = _last_eval(run)
    assert set(expected) <= set(summary["metrics"])
    assert {k: summary["metrics"][k] for k in expected} == expected  # same checkpoint, same seed: exactly
    assert summary["step"] == 1 and summary["metrics"]["eval/digits/pass@2"] >= summary["metrics"]["eval/digits/pass@1"]
    samples = [json.loads(line) for line in (run / "eval" / "iter_0000001" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 48 * 4 and {s["dataset"] for s in samples} == {"digits"}
    assert sum(s["reward"] for s in samples) / len(samples) == expected["eval/digits/reward_mean"]
    assert "eval at step 1" in done.stdout and "pass@4" in done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "raygym.engines.raygym_server.server" in cmdline and marker in cmdline:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("frontend", ["auto", "ray-serve"])
def test_serve_answers_the_openai_client_and_refuses_without_the_key(runs, frontend):
    """One box and one replica: ``auto`` serves without Ray Serve (raygym.serve.direct); ``ray-serve`` deploys
    the same front as a Serve replica. Both answer the same routes the same way."""
    import httpx
    import openai

    run = runs[0]
    port = _free_port()
    env, ray_tmp = _env(RAYGYM_SERVE_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "raygym", "serve", str(run), "--port", str(port),
                             "--frontend", frontend],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    printed: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            printed.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        base = None
        while base is None:
            line = lines.get(timeout=240)
            assert line is not None, "".join(printed)[-4000:]
            match = re.search(r"serving (\S+) at (http://\S+/v1)", line)
            if match:
                model, base = match.group(1), match.group(2)
                assert ("no Ray Serve" in line) == (frontend == "auto"), line
        assert KEY not in "".join(printed)

        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [model] and model.endswith("-iter_0000001")
        first = client.completions.create(model=model, prompt="next:3=", max_tokens=4, n=2, seed=11)
        again = client.completions.create(model=model, prompt="next:3=", max_tokens=4, n=2, seed=11)
        assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded rows repeat exactly
        assert [c.index for c in first.choices] == [0, 1] and first.usage.prompt_tokens == 7
        assert all(c.finish_reason in ("stop", "length") for c in first.choices)
        assert first.usage.completion_tokens <= 8

        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "next:4="}],
                                              max_tokens=5, seed=3, logprobs=True)
        choice = chat.choices[0]
        assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
        assert len(choice.logprobs.content) == chat.usage.completion_tokens and chat.usage.prompt_tokens == 7

        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "next:4="}],
                                                max_tokens=5, seed=3, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
        streamed: dict[int, str] = {}  # the choices' chunks interleave as the engine generates them together
        for chunk in client.completions.create(model=model, prompt="next:3=", max_tokens=4, n=2, seed=11, stream=True):
            for part in chunk.choices:
                streamed[part.index] = streamed.get(part.index, "") + part.text
        assert [streamed[i] for i in sorted(streamed)] == [c.text for c in first.choices]
        # a multi-token answer streams as it is generated: its first token arrives alone, the rest after it
        seed = next(s for s in range(50) if len(client.completions.create(
            model=model, prompt="next:5=", max_tokens=6, seed=s, temperature=1.0).choices[0].text) >= 3)
        whole = client.completions.create(model=model, prompt="next:5=", max_tokens=6, seed=seed, temperature=1.0)
        parts = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="next:5=", max_tokens=6, seed=seed, temperature=1.0, stream=True) if c.choices]
        assert len([p for p in parts if p]) > 1 and "".join(parts) == whole.choices[0].text

        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=base, api_key="not-the-key", max_retries=0).models.list()
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        bare = httpx.post(f"{base}/chat/completions", json={"model": model, "messages": [{"role": "user",
                                                                                          "content": "x"}]})
        assert bare.status_code == 401 and set(bare.json()["error"]) == {"message", "type", "param", "code"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4o", prompt="x")
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=model, prompt="next:3=", max_tokens=10_000)
        assert bad.value.body["code"] == "context_length_exceeded"
        exported = next(line for line in printed if line.startswith("model:")).split("-> ")[-1].strip()
        assert _engine_processes(exported), "the replica's engine server should be running"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, "".join(printed)[-4000:]
    assert not _engine_processes(exported), "Ctrl-C must end the engine servers"


@pytest.mark.browser
def test_report_of_two_runs_renders_in_chromium(runs, tmp_path):
    if not Path(CHROMIUM).exists():
        print(f"skipping: {CHROMIUM} is missing (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")

    out = tmp_path / "report.html"
    done = _raygym("report", str(runs[0]), str(runs[1]), "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    errors: list[str] = []
    fetched: list[str] = []
    shot = tmp_path / "report.png"
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request", lambda req: fetched.append(req.url) if not req.url.startswith("file://") else None)
            page.goto(out.as_uri())
            page.wait_for_selector("body[data-rendered=true]", timeout=30_000)
            for section in ("runs", "config", "curves", "traces"):
                assert page.get_attribute(f"section#{section}", "data-rendered") == "true", section
            assert page.locator("#runs-body tbody tr").count() == 2
            assert page.locator("#config-body td", has_text="recipe.lr").count() == 1
            for chart in ("reward", "eval-reward", "eval-pass", "entropy", "grad-norm", "response-len", "phases",
                          "sync-bytes", "sync-seconds"):
                assert page.locator(f"#chart-{chart} svg path[data-key]").count() >= 2, chart  # both runs
            page.hover("#chart-reward svg")
            assert page.locator("#chart-reward .tip").is_visible()
            rows = page.locator("#trace-table tbody tr")
            assert rows.count() > 0
            page.fill("#traces-body input[type=search]", "no response contains this")
            assert rows.count() == 0
            page.fill("#traces-body input[type=search]", "")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == [] and fetched == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"report screenshot: {shot}")
