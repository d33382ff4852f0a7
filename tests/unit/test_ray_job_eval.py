"""raygym.launchers.ray_job's eval jobs (pure parts): the entrypoint, secrets kept off the command line, the CLI split."""

from __future__ import annotations

import shlex

import pytest

from raygym.errors import ConfigError
from raygym.launchers import ray_job
from raygym.launchers.ray_job import build_eval_entrypoint, build_eval_job_spec


def test_eval_entrypoint_and_runtime_env():
    assert shlex.split(build_eval_entrypoint("/runs/r 1", ["--prompt-data", "s3://b/t.jsonl"])) == [
        "python", "-m", "raygym", "eval", "/runs/r 1", "--prompt-data", "s3://b/t.jsonl"]
    spec = build_eval_job_spec("/runs/r1", ["--step", "3"], environ={"HF_TOKEN": "hf_secret_value"},
                               working_dir="/repo", extra_env={"A": "1"})
    assert spec.runtime_env["env_vars"] == {"A": "1", "HF_TOKEN": "hf_secret_value"}
    assert "hf_secret_value" not in spec.entrypoint and "hf_secret_value" not in spec.describe("http://h:8265")
    assert spec.runtime_env["working_dir"] == "/repo"


def test_eval_job_refuses_secrets_and_a_missing_checkpoint():
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        build_eval_job_spec("/runs/r1", ["--hf-token", "x"], environ={})
    with pytest.raises(ConfigError, match="command line"):
        build_eval_job_spec("/runs/r1", ["--prompt-data", "s3://hf_secret_value/t"],
                            environ={"HF_TOKEN": "hf_secret_value"})
    with pytest.raises(ConfigError, match="checkpoint first"):
        build_eval_job_spec("--step", ["3"], environ={})


def test_cli_sends_eval_jobs_to_submit_eval_job(monkeypatch):
    calls = []
    outcome = ray_job.JobOutcome("job-1", "SUCCEEDED")
    monkeypatch.setattr(ray_job, "submit_eval_job", lambda *a, **k: calls.append(("eval", a, k)) or outcome)
    monkeypatch.setattr(ray_job, "submit_train_job", lambda *a, **k: calls.append(("train", a, k)) or outcome)
    assert ray_job.main(["--address", "http://h:8265", "--installed", "eval", "/runs/r1", "--step", "2"]) == 0
    assert ray_job.main(["--address", "http://h:8265", "--preset", "tiny"]) == 0
    assert [(c[0], c[1]) for c in calls] == [("eval", ("http://h:8265", "/runs/r1", ["--step", "2"])),
                                             ("train", ("http://h:8265", ["--preset", "tiny"]))]
    assert calls[0][2]["working_dir"] is None
    assert ray_job.main(["--address", "http://h:8265", "eval"]) == 2
