"""examples/vision: the README's commands. The tiny Qwen2.5-VL learns to count the squares in its image with
raygym's engine (every sync verified), and its answers follow the images: right on held-out rows, at chance when
the same prompts get each other's images (where it answers the count of the image it was shown)."""

from __future__ import annotations

import json

import pytest
from readme_runner import run_example

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_the_tiny_vlm_learns_to_count_and_its_answers_follow_the_image(tmp_path):
    rows = run_example("vision", tmp_path, train_flags=[])
    assert len(rows) == 200
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
