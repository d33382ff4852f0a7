"""`raygym serve --engine vllm` on vLLM's CPU build, driven by the `openai` client: completions and chat, whole and
streamed (the streamed text is the whole answer's, arriving as vLLM decodes it), the usage the stream reports, and
the refusal of a model vLLM's CPU attention cannot run, before Ray starts."""

from __future__ import annotations

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

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "vllm-serve-key-5d2e8a91c4"


def _env() -> tuple[dict[str, str], str]:
    ray_tmp = tempfile.mkdtemp(prefix="rgv-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "RAYGYM_SERVE_API_KEY": KEY,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RAY_ADDRESS", None)
    return env, ray_tmp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_head_size_vllm_cpu_cannot_run_before_ray_starts(vllm_python, tmp_path):
    from raygym.builtin import TINY_MODEL, materialize_model

    model = materialize_model(TINY_MODEL, tmp_path / "head16", seed=0)  # the builtin tiny model: head_dim 16
    env, ray_tmp = _env()
    try:
        done = subprocess.run([sys.executable, "-m", "raygym", "serve", model, "--engine", "vllm",
                               "--engine-python", vllm_python, "--port", str(_free_port())],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "head_dim=16" in done.stderr and "vLLM's CPU attention" in done.stderr
    assert "Started a local Ray instance" not in done.stdout + done.stderr  # refused before Ray


def test_serve_with_the_vllm_engine_answers_the_openai_client(vllm_python, vllm_model):
    import openai

    port = _free_port()
    env, ray_tmp = _env()
    proc = subprocess.Popen([sys.executable, "-m", "raygym", "serve", vllm_model, "--engine", "vllm",
                             "--engine-python", vllm_python, "--port", str(port), "--max-ongoing-requests", "8"],
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
            line = lines.get(timeout=600)
            assert line is not None, "".join(printed)[-4000:]
            match = re.search(r"serving (\S+) at (http://\S+/v1)", line)
            if match:
                model, base = match.group(1), match.group(2)
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [model]

        whole = client.completions.create(model=model, prompt="next:3=", max_tokens=6, n=2, seed=11, logprobs=0)
        again = client.completions.create(model=model, prompt="next:3=", max_tokens=6, n=2, seed=11)
        assert [c.text for c in whole.choices] == [c.text for c in again.choices]  # seeded rows repeat exactly
        assert [c.index for c in whole.choices] == [0, 1] and whole.usage.prompt_tokens == 7
        assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0 for c in whole.choices)

        streamed: dict[int, list[str]] = {0: [], 1: []}
        chunks = list(client.completions.create(model=model, prompt="next:3=", max_tokens=6, n=2, seed=11,
                                                stream=True, stream_options={"include_usage": True}))
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index].append(choice.text)
        assert ["".join(parts) for _, parts in sorted(streamed.items())] == [c.text for c in whole.choices]
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "next:4="}],
                                              max_tokens=5, seed=3)
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "next:4="}],
                                                max_tokens=5, seed=3, stream=True)
        content = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert "".join(content) == chat.choices[0].message.content and content
        with pytest.raises(openai.BadRequestError) as bad:  # past vLLM's context: refused by the front, a 400
            client.completions.create(model=model, prompt="next:3=", max_tokens=100_000)
        assert bad.value.body["code"] == "context_length_exceeded"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, "".join(printed)[-4000:]
