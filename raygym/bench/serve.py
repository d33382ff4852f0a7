"""Requests/s and time to first token through ``raygym serve`` vs the same engine's ``/generate`` called directly
with :class:`~raygym.engine_api.client.EngineClient`, for each ``--frontends``: ``direct`` (the one-box server,
``raygym.serve.direct``: the OpenAI front under uvicorn in the serving process, what one replica without a Ray
cluster gets) and ``ray-serve`` (Ray Serve's proxy + a replica holding the front + EngineActor).

Both sides send the same ``--requests`` completion requests (one prompt, at most ``--new-tokens`` tokens,
greedy, so both generate the same tokens) with ``--concurrency`` in flight, to one raygym-server engine of the
builtin tiny model on CPU. The baseline engine runs in this process's own EngineActor; the served one inside a
Serve replica of a private local Ray. The ratio served/direct is the figure: what the OpenAI front and Serve's
HTTP proxy cost per request. Time to first token (``--ttft-requests`` streamed requests, one at a time):
a streamed completion (``stream: true``, server-sent events) against the engine's own stream. Both sides use
aiohttp clients (the engine's :class:`EngineClient` is aiohttp), so the ratio is the server's cost; the
``openai`` client against ``raygym serve`` is tested in ``tests/e2e/test_after_training.py``.

    raygym bench serve [--requests 128] [--concurrency 8] [--new-tokens 8] [--repeats 3] \
        [--frontends direct,ray-serve]

Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

from raygym.builtin import TINY_MODEL, build_tokenizer, materialize_model, next_digit_rows

KEY = "benchmark-serve-key-0123456789"


def prompts(n: int) -> list[str]:
    return [row["prompt"] for row in next_digit_rows(n, seed=0)]


async def _drive(send, texts: list[str], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, text: str) -> None:
        async with gate:
            await send(i, text)

    start = time.perf_counter()
    await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    return time.perf_counter() - start


def direct(model_dir: str, texts: list[str], new_tokens: int, concurrency: int, repeats: int,
           ttft_requests: int) -> tuple[list[float], list[float]]:
    """(seconds per repeat, time to first token per streamed request) against the engine itself."""
    from raygym.engine_api.client import EngineClient
    from raygym.engine_api.protocol import GenerateRequest
    from raygym.engines.actor import EngineActor
    from raygym.serve.replica_engine import engine_recipe

    tok = build_tokenizer()
    recipe = engine_recipe({"sglang_max_running_requests": 64, "rollout_num_gpus": 1,  # as serve's engine
                            "rollout_num_gpus_per_engine": 1})
    engine = EngineActor(recipe, engine_index=0, model_path=model_dir,
                         gpu_ids=[], backend="raygym", device="cpu", log_dir=tempfile.mkdtemp(prefix="bench-serve-"))
    engine.start()

    def request(text: str) -> GenerateRequest:
        return GenerateRequest(input_ids=[tok.encode(text)], return_logprob=True,
                               sampling_params=[{"max_new_tokens": new_tokens, "temperature": 0.0}])

    try:
        async def run() -> tuple[list[float], list[float]]:
            async with EngineClient(engine.url()) as client:
                async def send(i: int, text: str) -> None:
                    await client.generate(request(text))

                await _drive(send, texts[:16], concurrency)  # warm-up
                seconds = [await _drive(send, texts, concurrency) for _ in range(repeats)]
                firsts = []
                for text in texts[:ttft_requests]:
                    start = time.perf_counter()
                    async for _ in client.generate_stream(request(text)):
                        firsts.append(time.perf_counter() - start)
                        break
                return seconds, firsts
        return asyncio.run(run())
    finally:
        engine.close()


def served(model_dir: str, texts: list[str], new_tokens: int, concurrency: int, repeats: int,
           ttft_requests: int, frontend: str) -> tuple[list[float], list[float]]:
    """(seconds per repeat, time to first token per streamed request) through ``raygym serve``, run as users
    run it (its own process: the clients here never share an interpreter with the front)."""
    import queue
    import re
    import signal
    import subprocess

    import aiohttp
    import httpx

    port = 18000 + os.getpid() % 1000
    env = {**os.environ, "RAYGYM_SERVE_API_KEY": KEY, "RAY_AUTH_MODE": "disabled",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="bench-serve-ray-")}
    proc = subprocess.Popen([sys.executable, "-m", "raygym", "serve", model_dir, "--engine", "raygym", "--port",
                             str(port), "--frontend", frontend, "--max-ongoing-requests", "64",
                             "--gpus-per-replica", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    printed: list[str] = []
    try:
        url = None
        while url is None:
            line = lines.get(timeout=300)
            if line is None:
                raise RuntimeError("raygym serve exited:\n" + "".join(printed)[-3000:])
            printed.append(line)
            match = re.search(r"serving \S+ at (http://\S+/v1)", line)
            url = match.group(1) if match else None
        headers = {"Authorization": f"Bearer {KEY}"}
        model = httpx.get(f"{url}/models", headers=headers).json()["data"][0]["id"]

        # aiohttp, as the baseline's EngineClient: the ratio is the server's cost, not two client libraries'
        # (httpx.AsyncClient on this side measured 0.77 where aiohttp measures 0.84, same server)
        async def run(count: int | None = None) -> float:
            async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as client:
                async def send(i: int, text: str) -> None:
                    async with client.post(f"{url}/completions", json={
                            "model": model, "prompt": text, "temperature": 0, "max_tokens": new_tokens}) as r:
                        r.raise_for_status()
                        await r.read()
                return await _drive(send, texts[:count] if count else texts, concurrency)

        async def first_tokens() -> list[float]:
            out = []
            async with aiohttp.ClientSession(headers=headers) as client:
                for text in texts[:ttft_requests]:
                    start = time.perf_counter()
                    async with client.post(f"{url}/completions", json={
                            "model": model, "prompt": text, "temperature": 0, "max_tokens": new_tokens,
                            "stream": True}) as r:
                        r.raise_for_status()
                        async for raw in r.content:  # server-sent events, one per line
                            line = raw.decode().strip()
                            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                                out.append(time.perf_counter() - start)
                                break
            return out

        asyncio.run(run(16))  # warm-up
        seconds = [asyncio.run(run()) for _ in range(repeats)]
        return seconds, asyncio.run(first_tokens())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=16)
    parser.add_argument("--frontends", default="direct,ray-serve", help="comma-separated: direct, ray-serve")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    model_dir = materialize_model(TINY_MODEL, tempfile.mkdtemp(prefix="bench-serve-model-"))
    texts = prompts(args.requests)
    direct_s, direct_ttft = direct(model_dir, texts, args.new_tokens, args.concurrency, args.repeats,
                                   args.ttft_requests)
    machine = {"cpus": os.cpu_count(), "device": "cpu", "python": platform.python_version()}
    d, ds = statistics.median(direct_s), statistics.median(direct_ttft)
    for frontend in [f.strip() for f in args.frontends.split(",") if f.strip()]:
        served_s, served_ttft = served(model_dir, texts, args.new_tokens, args.concurrency, args.repeats,
                                       args.ttft_requests, frontend)
        s = statistics.median(served_s)
        print(json.dumps({
            "figure": "serve_requests_per_s", "frontend": frontend, "value": args.requests / s,
            "baseline": "engine_direct_requests_per_s", "baseline_value": args.requests / d, "ratio": d / s,
            "requests": args.requests, "concurrency": args.concurrency, "new_tokens": args.new_tokens,
            "seconds_served": served_s, "seconds_direct": direct_s, "machine": machine,
        }), flush=True)
        ss = statistics.median(served_ttft)
        print(json.dumps({
            "figure": "serve_time_to_first_token_s", "frontend": frontend, "value": ss,
            "baseline": "engine_direct_time_to_first_token_s", "baseline_value": ds, "ratio": ss / ds,
            "ratio_is": "served / direct (1.0: the front adds nothing)", "streamed_requests": len(served_ttft),
            "new_tokens": args.new_tokens, "ttft_served": served_ttft, "ttft_direct": direct_ttft, "machine": machine,
        }), flush=True)

if __name__ == "__main__":
    main()
