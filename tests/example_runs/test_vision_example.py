"""examples/vision: the README's commands. The tiny Qwen2.5-VL learns to count the squares in its image with
raygym's engine (every sync verified), and its answers follow the images: right on held-out rows, at chance when
the same prompts get each other's images (where it answers the count of the image it was shown). Then
``raygym serve`` answers the ``openai`` client's image content parts with the trained model."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from readme_runner import REPO_ROOT, run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_the_tiny_vlm_learns_to_count_and_its_answers_follow_the_image(tmp_path):
    rows = run_example("vision", tmp_path, train_flags=[])
    assert len(rows) == 120
    assert all(r["sync/verified_tensors"] == 57 and r["rollout/logprob_mismatch_max"] < 1e-4 for r in rows)
    early = sum(r["rollout/reward_mean"] for r in rows[:10]) / 10
    late = sum(r["rollout/reward_mean"] for r in rows[-10:]) / 10
    assert early < 0.3 and late > 0.6, (early, late)

    def evaluated(name: str) -> tuple[float, list[dict]]:
        out = tmp_path / "vision-eval" / name
        metrics = json.loads((out / "metrics.json").read_text())["metrics"]
        return metrics[f"eval/{name}/pass@1"], [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]

    held_out, _ = evaluated("heldout")
    shuffled, samples = evaluated("swapped")
    data = [json.loads(x) for x in (tmp_path / "vision-data" / "swapped.jsonl").read_text().splitlines()]
    chance = sum(r["label"] == r["image_count"] for r in data) / len(data)
    follows_image = sum(s["response"][:1] == data[s["data_index"]]["image_count"] for s in samples) / len(samples)
    assert held_out > 0.6 and abs(shuffled - chance) < 0.15 and follows_image > 0.6, (held_out, shuffled, chance,
                                                                                       follows_image)

    served = serve_accuracy(tmp_path / "vision", [json.loads(x) for x in
                                                   (tmp_path / "vision-data" / "heldout.jsonl").read_text().splitlines()][:16])
    assert served > 0.6, served


def serve_accuracy(run: Path, rows: list[dict]) -> float:
    """``raygym serve RUN`` (one box), asked each row's count through the ``openai`` client with the image as a
    data-URL content part; the share answered right."""
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "vision-serve-test-key"
    ray_tmp = tempfile.mkdtemp(prefix="rgv-", dir="/tmp")
    env = {**os.environ, "RAYGYM_SERVE_API_KEY": key, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    proc = subprocess.Popen([sys.executable, "-m", "raygym", "serve", str(run), "--port", str(port)], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=240)
            assert line is not None, "raygym serve exited before it served"
            match = re.search(r"serving (\S+) at (http://\S+/v1)", line)
            if match:
                break
        client = openai.OpenAI(base_url=match.group(2), api_key=key, max_retries=0)
        right = 0
        for row in rows:
            out = client.chat.completions.create(model=match.group(1), temperature=0, max_tokens=1, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": row["images"][0]}},
                                             {"type": "text", "text": "count:"}]}])
            right += (out.choices[0].message.content or "")[:1] == row["label"]
        return right / len(rows)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
