"""Requests/s and time to first token through ``raygym serve`` (Ray Serve proxy + replica + OpenAI front +
EngineActor) vs the same engine's ``/generate`` called directly with :class:`~raygym.engine_api.client.EngineClient`.

Both sides send the same ``--requests`` completion requests (one prompt, at most ``--new-tokens`` tokens,
greedy, so both generate the same tokens) with ``--concurrency`` in flight, to one raygym-server engine of the
builtin tiny model on CPU. The baseline engine runs in this process's own EngineActor; the served one inside a
Serve replica of a private local Ray. The ratio served/direct is the figure: what the OpenAI front and Serve's
HTTP proxy cost per request. Time to first token (``--ttft-requests`` streamed requests, one at a time):
through the ``openai`` client's ``stream=True`` against the engine's own stream (``stream: true``).

    python benchmarks/serve.py [--requests 128] [--concurrency 8] [--new-tokens 8] [--repeats 3]

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raygym.builtin import TINY_MODEL, build_tokenizer, materialize_model, next_digit_rows  # noqa: E402

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
    from raygym.presets import tiny

    tok = build_tokenizer()
    engine = EngineActor(tiny().replace(sglang_max_running_requests=64), engine_index=0, model_path=model_dir,
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
           ttft_requests: int) -> tuple[list[float], list[float]]:
    """(seconds per repeat, time to first token per streamed request) through ``raygym serve``."""
    import httpx
    import openai

    from raygym.serve.deployment import ServeSettings, run_server

    port = 18000 + os.getpid() % 1000
    settings = ServeSettings(model_dir=model_dir, model_name="tiny", engine="raygym", gpus_per_replica=0,
                             max_ongoing_requests=64, engine_settings={"sglang_max_running_requests": 64})
    stop = threading.Event()
    seconds: list[float] = []
    firsts: list[float] = []

    def measure(endpoint) -> None:  # runs once the deployment answers; the server then stops
        async def run(count: int | None = None) -> float:
            async with httpx.AsyncClient(base_url=endpoint.url, headers={"Authorization": f"Bearer {KEY}"},
                                         timeout=120) as client:
                async def send(i: int, text: str) -> None:
                    r = await client.post("/completions", json={"model": "tiny", "prompt": text, "temperature": 0,
                                                                "max_tokens": new_tokens})
                    r.raise_for_status()
                return await _drive(send, texts[:count] if count else texts, concurrency)

        async def first_tokens() -> list[float]:
            client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=KEY, max_retries=0)
            out = []
            for text in texts[:ttft_requests]:
                start = time.perf_counter()
                stream = await client.completions.create(model="tiny", prompt=text, temperature=0,
                                                         max_tokens=new_tokens, stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        out.append(time.perf_counter() - start)
                        break
                await stream.close()
            await client.close()
            return out

        try:
            asyncio.run(run(16))  # warm-up
            seconds.extend(asyncio.run(run()) for _ in range(repeats))
            firsts.extend(asyncio.run(first_tokens()))
        finally:
            stop.set()

    run_server(settings, KEY, port=port, stop=stop, on_ready=measure, say=lambda _: None)
    return seconds, firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    model_dir = materialize_model(TINY_MODEL, tempfile.mkdtemp(prefix="bench-serve-model-"))
    texts = prompts(args.requests)
    direct_s, direct_ttft = direct(model_dir, texts, args.new_tokens, args.concurrency, args.repeats,
                                   args.ttft_requests)
    served_s, served_ttft = served(model_dir, texts, args.new_tokens, args.concurrency, args.repeats,
                                   args.ttft_requests)
    d, s = statistics.median(direct_s), statistics.median(served_s)
    machine = {"cpus": os.cpu_count(), "device": "cpu", "python": platform.python_version()}
    print(json.dumps({
        "figure": "serve_requests_per_s", "value": args.requests / s,
        "baseline": "engine_direct_requests_per_s", "baseline_value": args.requests / d, "ratio": d / s,
        "requests": args.requests, "concurrency": args.concurrency, "new_tokens": args.new_tokens,
        "seconds_served": served_s, "seconds_direct": direct_s, "machine": machine,
    }))
    ds, ss = statistics.median(direct_ttft), statistics.median(served_ttft)
    print(json.dumps({
        "figure": "serve_time_to_first_token_s", "value": ss, "baseline": "engine_direct_time_to_first_token_s",
        "baseline_value": ds, "ratio": ss / ds, "ratio_is": "served / direct (1.0: the front adds nothing)",
        "streamed_requests": len(served_ttft), "new_tokens": args.new_tokens, "ttft_served": served_ttft,
        "ttft_direct": direct_ttft, "machine": machine,
    }))


if __name__ == "__main__":
    main()
