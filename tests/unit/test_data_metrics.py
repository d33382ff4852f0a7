"""The prompt data's load-time counts as run metrics: rows skipped for images that could not be used
(``data/num_bad_images``) and rows dropped rather than cut through an image (``data/num_image_cuts``), from the
dataset through the rollout manager to the first row of ``metrics.jsonl``."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest
from PIL import Image

from raygym.builtin import build_tokenizer
from raygym.builtin.tiny_vlm import build_image_processor, build_vlm_tokenizer
from raygym.config import DatasetConfig, ModelConfig, TrainConfig
from raygym.data.check import check_prompt_data
from raygym.data.prompts import PromptDataset
from raygym.presets import tiny
from raygym.rollout.manager import RolloutManager
from raygym.run.loop import Loop, PendingCheckpoint
from raygym.run.metrics import MetricsLogger, PhaseTimer
from raygym.types import Sample
from raygym.vision.images import encode_image

REMOTE = "memory://data-metrics"


@pytest.fixture(scope="module")
def tok():
    return build_vlm_tokenizer()


@pytest.fixture(scope="module")
def proc():
    return build_image_processor()


def picture() -> Image.Image:
    return Image.new("RGB", (56, 56), (255, 0, 0))


def remote_rows_with_one_unreadable_image() -> str:
    """A remote jsonl file (its images are read when the data loads, not by the up-front check) whose second
    row names an image that is not there."""
    buffer = io.BytesIO()
    picture().save(buffer, format="PNG")
    with fsspec.open(f"{REMOTE}/ok.png", "wb") as fh:
        fh.write(buffer.getvalue())
    rows = [{"prompt": "a", "label": "", "images": [f"{REMOTE}/ok.png"]},
            {"prompt": "b", "label": "", "images": [f"{REMOTE}/gone.png"]},
            {"prompt": "c", "label": "", "images": [encode_image(picture())]}]
    url = f"{REMOTE}/rows.jsonl"
    with fsspec.open(url, "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows))
    return url


def test_a_row_whose_image_cannot_be_read_at_load_time_is_a_counted_metric(tok, proc):
    url = remote_rows_with_one_unreadable_image()
    assert check_prompt_data(url, image_key="images").rows == 3  # nothing to see up front: the images are remote
    ds = PromptDataset.from_url(url, tok, image_key="images", image_processor=proc, shuffle=False)
    assert [r.prompt for r in ds] == ["a", "c"]
    assert ds.load_metrics() == {"data/num_bad_images": 1.0, "data/num_image_cuts": 0.0}


def test_a_row_truncation_would_cut_through_an_image_is_a_counted_metric(tok, proc):
    rows = [{"prompt": "abcdef", "label": "", "images": [encode_image(picture())]},  # 12 tokens, 4 of them image
            {"prompt": "abcdefghij", "label": "", "images": []}]
    ds = PromptDataset(rows, tok, image_key="images", image_processor=proc, shuffle=False, max_prompt_len=8,
                       prompt_len_policy="truncate")
    assert len(ds) == 1 and ds.load_metrics() == {"data/num_bad_images": 0.0, "data/num_image_cuts": 1.0}


def test_a_text_dataset_has_no_image_metrics():
    ds = PromptDataset([{"prompt": "2+2=", "label": "4"}], build_tokenizer())
    assert ds.load_metrics() == {}


# ── through the loop: the first row of metrics.jsonl ──────────────────────────────────────────────────────────

class Remote:
    """An actor method as the loop calls it (``.remote(...)``); the patched ``ray.get`` returns the value."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeManager:
    """The rollout manager's side of the loop, over a real dataset: one one-sample group per step."""

    def __init__(self, dataset: PromptDataset) -> None:
        self.dataset = dataset
        self.generate = Remote(self._generate)
        self.metrics = Remote(lambda: {"rollout/reward_mean": 0.0, "perf/rollout_time": 0.0})
        self.data_state = Remote(lambda: {"train": dataset.state_dict()})
        self.data_metrics = Remote(lambda: RolloutManager.data_metrics(self))  # type: ignore[arg-type]

    def _generate(self, step: int, version: int) -> list[Sample]:
        row = self.dataset.next_batch(1)[0]
        return [Sample(prompt=row.prompt, prompt_tokens=row.prompt_tokens, group_index=0, data_index=row.data_index,
                       response_tokens=[1], weight_version=version)]


class StubLoop(Loop):
    """The loop without trainers or engines: training, checkpoints and the weight sync do nothing."""

    def train_on(self, samples: list[Any], step: int, timer: PhaseTimer) -> dict[str, float]:
        return {}

    def save(self, step: int, data_state: dict[str, Any]) -> PendingCheckpoint:
        return PendingCheckpoint(policy_url="unused")

    def commit(self, pending: PendingCheckpoint) -> None:
        pass

    def sync(self, version: int, step: int, timer: PhaseTimer) -> dict[str, float]:
        self.version = version
        return {}


def test_the_counts_land_in_the_first_row_of_metrics_jsonl(tmp_path, tok, proc, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, **_: value)
    ds = PromptDataset.from_url(remote_rows_with_one_unreadable_image(), tok, image_key="images",
                                image_processor=proc, shuffle=False)
    cfg = TrainConfig(recipe=tiny().replace(num_rollout=3, save_interval=100), output_dir=str(tmp_path),
                      model=ModelConfig(hf_checkpoint="builtin:tiny-qwen2.5-vl"),
                      dataset=DatasetConfig(prompt_data=f"{REMOTE}/rows.jsonl"))
    graph = SimpleNamespace(manager=FakeManager(ds), fleet=None, trainers=None, critics=None)
    loop = StubLoop(cfg, graph, SimpleNamespace(print=lambda *a, **k: None))  # type: ignore[arg-type]
    with MetricsLogger(tmp_path) as metrics:
        assert loop.run(0, metrics) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (rows[0]["data/num_bad_images"], rows[0]["data/num_image_cuts"]) == (1.0, 0.0)
    assert not any(key.startswith("data/") for r in rows[1:] for key in r)  # logged once, with the first step
