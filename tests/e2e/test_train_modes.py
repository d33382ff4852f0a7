"""The training loop end to end on CPU: sync, colocated and async modes, 3 steps each with 2 engines.

Every run is a real one (local Ray with logical GPUs, raygym.s HTTP servers, torch
training, gloo weight sync). After each step a log hook reads every engine's weight checksums over
HTTP; after the run they are compared with the weights of the final checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from raygym import DatasetConfig, ModelConfig, Recipe, TrainConfig
from raygym.builtin import NEXT_DIGIT_TASK, TINY_MODEL
from raygym.presets import tiny

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def tiny_config(out: Path, eval_data: dict[str, str] | None = None, **overrides: Any) -> TrainConfig:
    """The tiny preset, shrunk to a few seconds per step."""
    fields = {**tiny().model_dump(), "rollout_batch_size": 4, "n_samples_per_prompt": 4,
              "global_batch_size": 16, "num_rollout": 3, "save_interval": 1000, **overrides}
    return TrainConfig(recipe=Recipe(**fields), model=ModelConfig(hf_checkpoint=TINY_MODEL),
                       dataset=DatasetConfig(prompt_data=NEXT_DIGIT_TASK, eval_prompt_data=eval_data or {}),
                       output_dir=str(out))


def eval_file(directory: Path) -> str:
    """Four next-digit prompts, written apart from the training data."""
    from raygym.builtin import next_digit_rows

    path = directory / "eval_digits.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in next_digit_rows(4, seed=99)))
    return str(path)


def engine_urls(run_dir: str | Path) -> list[str]:
    """Base URLs of the raygym servers of this run (their argv names the run's model cache)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "raygym.engines.raygym_server.server" in argv and any(str(run_dir) in a for a in argv):
            host, port = argv[argv.index("--host") + 1], argv[argv.index("--port") + 1]
            found.append(f"http://{host}:{port}")
    return sorted(found)


def get_json(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """An engine route, with the run's engine API key (the driver, this process, minted it)."""
    from raygym.engine_api.auth import auth_headers

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **auth_headers()})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


class EngineAudit:
    """A ``custom_rollout_log_function``: after each step's sync, every engine's checksums and state."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.steps: list[dict[str, Any]] = []

    def __call__(self, rollout_id: int, samples: list[Any], row: dict[str, Any]) -> dict[str, float]:
        engines = {}
        for url in engine_urls(self.run_dir):
            stats = get_json(f"{url}/raygym/stats")
            sums = get_json(f"{url}/raygym/weights_checksum", {"names": None})
            engines[url] = {"released": stats["released"], **sums}
        self.steps.append({"rollout_id": rollout_id, "samples": len(samples), "engines": engines})
        return {"audit/engines": float(len(engines))}


def released_during_training(probe_dir: str):
    """A ``custom_megatron_before_train_step_hook`` (runs in the trainer actor): records what the
    colocated engines hold released while the trainer is about to train."""

    def hook(args: Any, rollout_id: int, batch: Any) -> Any:
        states = [get_json(f"{url}/raygym/stats")["released"] for url in engine_urls(probe_dir)]
        line = json.dumps({"rollout_id": rollout_id, "pid": os.getpid(), "released": states})
        with open(Path(probe_dir) / "train_probe.jsonl", "a") as f:
            f.write(line + "\n")
        return batch

    return hook


def checkpoint_checksums(checkpoint: str) -> dict[str, str]:
    from raygym.checkpoint.store import load_checkpoint
    from raygym.weightsync.codec import checksum

    state = load_checkpoint(checkpoint, load_optimizer=False).model_state
    return {name: checksum(t.contiguous()) for name, t in state.items()}


MODES = {
    # sync also covers eval + its log hook and sampled request traces; async covers substep_timing="off"
    "sync": {"rollout_num_gpus": 2, "eval_interval": 2, "n_samples_per_eval_prompt": 2, "capture_trace": True,
             "trace_sample_limit": 3},
    "colocate": {"colocate": True, "actor_num_gpus_per_node": 2, "rollout_num_gpus": 2},
    "async": {"async_mode": True, "rollout_num_gpus": 2, "substep_timing": "off"},
}


class EvalAudit:
    """A ``custom_eval_rollout_log_function``: what each eval passed to the hook."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, int], list[str]]] = []

    def __call__(self, rollout_id: int, samples: dict[str, list[Any]], row: dict[str, Any]) -> dict[str, float]:
        self.calls.append((rollout_id, {k: len(v) for k, v in samples.items()}, sorted(row)))
        return {"eval/digits/audited": 1.0}


@pytest.mark.parametrize("mode", list(MODES))
def test_three_steps_two_engines(mode, ray_local, tmp_path):
    import ray.cloudpickle

    from raygym.run.driver import train

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hook travels to the trainers
    audit = EngineAudit(tmp_path)
    eval_audit = EvalAudit()
    overrides = dict(MODES[mode], save_interval=3, custom_rollout_log_function=audit)
    if mode == "colocate":
        overrides["custom_megatron_before_train_step_hook"] = released_during_training(str(tmp_path))
    eval_data = None
    if mode == "sync":
        eval_data = {"digits": eval_file(tmp_path)}
        overrides["custom_eval_rollout_log_function"] = eval_audit
    result = train(tiny_config(tmp_path, eval_data, **overrides))

    assert result.final_step == 2
    rows = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "perf/step_time", "perf/rollout_time",
                    "perf/train_time", "perf/sync_time", "train/loss"):
            assert isinstance(r[key], (int, float)), (key, r.get(key))
        assert r["sync/full_resyncs"] == 0  # every engine's checksums matched the sender's at every sync
        assert r["sync/engines"] == 2 and r["audit/engines"] == 2
        assert r["rollout/samples"] == 16
        assert r["rollout/engine0_requests"] > 0 and r["rollout/engine1_requests"] > 0

    # After every sync both engines serve version step+1 with identical weights, nothing released.
    assert [a["rollout_id"] for a in audit.steps] == [0, 1, 2]
    for a in audit.steps:
        engines = list(a["engines"].values())
        assert len(engines) == 2
        assert all(e["weight_version"] in (a["rollout_id"] + 1, str(a["rollout_id"] + 1)) for e in engines)
        assert engines[0]["checksums"] == engines[1]["checksums"]
        assert all(e["released"] == [] for e in engines)
    assert audit.steps[0]["engines"] != audit.steps[2]["engines"]  # training changed the weights
    # ... and equal to what the trainer saved after the last step.
    saved = checkpoint_checksums(result.checkpoint_paths[-1])
    served = list(audit.steps[-1]["engines"].values())[0]["checksums"]
    common = set(saved) & set(served)
    assert len(common) >= len(served) - 1  # lm_head may be tied to the embedding on one side
    assert {n: served[n] for n in common} == {n: saved[n] for n in common}
    assert result.hf_export_path and (Path(result.hf_export_path) / "config.json").exists()
    assert result.reward_curve_path and Path(result.reward_curve_path).stat().st_size > 0

    if mode == "colocate":
        for step in range(3):
            order = [e.split(":", 1)[1] for e in result.events if e.startswith(f"{step}:")]
            assert order == ["engines.release", "trainers.onload", "train", "trainers.offload",
                             "engines.resume_weights", "sync", "engines.resume_kv_cache"], order
        probes = [json.loads(line) for line in (tmp_path / "train_probe.jsonl").read_text().splitlines()]
        assert sorted({p["rollout_id"] for p in probes}) == [0, 1, 2]
        for p in probes:  # while the trainers train, both engines hold weights and KV cache released
            assert len(p["released"]) == 2
            assert all(set(r) >= {"weights", "kv_cache"} for r in p["released"]), p
    else:
        assert [e.split(":", 1)[1] for e in result.events] == ["train", "sync"] * 3

    if mode == "sync":
        # eval after the sync of step 1 (eval_interval=2), with its keys in that step's row only
        assert [c[0] for c in eval_audit.calls] == [1]
        assert eval_audit.calls[0][1] == {"digits": 8}  # 4 prompts x n_samples_per_eval_prompt
        assert "eval/digits/reward_mean" in eval_audit.calls[0][2]
        assert [r["step"] for r in rows if "eval/digits/reward_mean" in r] == [1]
        assert rows[1]["eval/digits/audited"] == 1.0 and "eval/digits/pass@2" in rows[1]
        assert 0.0 <= rows[1]["eval/digits/reward_mean"] <= 1.0 and rows[1]["perf/eval_time"] > 0
        for step in range(3):
            traces = [json.loads(x) for x in (tmp_path / "traces" / f"step_{step:06d}.jsonl").read_text().splitlines()]
            assert len(traces) == 3  # trace_sample_limit
            for t in traces:
                assert t["step"] == step and t["engine"] in (0, 1) and t["weight_version"] == step
                assert t["queued"] <= t["sent"] <= t["done"] and t["response_tokens"] >= 1
        assert "perf/log_probs_time" in rows[0] and "perf/other_time" in rows[0]
    else:
        assert not (tmp_path / "traces").exists()
        assert not any(k.startswith("eval/") for r in rows for k in r)

    if mode == "async":
        assert "perf/log_probs_time" not in rows[0] and "perf/other_time" not in rows[0]  # substep_timing off
        assert rows[0]["rollout/staleness_max"] == 0
        for r in rows[1:]:
            # trained on samples of the previous policy: exactly one step stale, never more
            assert r["rollout/staleness_max"] == 1
            assert r["rollout/weight_version_max"] == r["step"] - 1
            # the rollout ran while the previous step trained: the driver barely waited for it
            assert r["perf/rollout_time"] < r["rollout/generate_time"]
    else:
        assert all(r["rollout/staleness_max"] == 0 for r in rows)
        assert [r["rollout/weight_version_min"] for r in rows] == [0, 1, 2]
