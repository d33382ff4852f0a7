"""``raygym.launchers.ray_job`` resubmits a failed training job so it resumes from its own checkpoints (the submission
itself is replaced by a recorder: what is sent is checked, not the cluster; tests/multinode runs it for real)."""

from __future__ import annotations

from typing import Any

import pytest

import raygym.launchers.ray_job as ray_job
from raygym.errors import ConfigError

RUN = ["--preset", "tiny", "--num-rollout", "4", "--output-dir", "/shared/runs/r1"]


class Recorder:
    """Stands in for ``submit_job_spec``: records each spec and answers with the next status."""

    def __init__(self, *statuses: str) -> None:
        self.statuses = list(statuses)
        self.entrypoints: list[str] = []

    def __call__(self, address: str, spec: ray_job.JobSpec, **kwargs: Any) -> ray_job.JobOutcome:
        self.entrypoints.append(spec.entrypoint)
        return ray_job.JobOutcome(f"job-{len(self.entrypoints)}", self.statuses.pop(0))


def test_resumable_args_load_the_runs_own_checkpoints() -> None:
    assert ray_job.resumable_args(RUN) == [*RUN, "--load", "/shared/runs/r1/checkpoints"]
    assert ray_job.resumable_args([*RUN, "--save", "s3://b/ck"])[-2:] == ["--load", "s3://b/ck"]
    assert ray_job.resumable_args([*RUN, "--load", "/x"]) == [*RUN, "--load", "/x"]
    with pytest.raises(ConfigError, match="--output-dir"):
        ray_job.resumable_args(["--preset", "tiny"])


def test_a_failed_job_is_submitted_again_with_the_same_resumable_command(monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    recorder = Recorder("FAILED", "SUCCEEDED")
    monkeypatch.setattr(ray_job, "submit_job_spec", recorder)
    outcome = ray_job.submit_train_job("http://head:8265", RUN, environ={}, working_dir=None, resubmits=2,
                                       out=said.append)
    assert outcome.status == "SUCCEEDED" and outcome.job_id == "job-2"
    assert len(recorder.entrypoints) == 2 and recorder.entrypoints[0] == recorder.entrypoints[1]
    assert recorder.entrypoints[0].endswith("--load /shared/runs/r1/checkpoints")
    assert any("job job-1 failed; resubmitting" in line for line in said)


def test_resubmissions_are_bounded_and_only_for_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder("FAILED", "FAILED")
    monkeypatch.setattr(ray_job, "submit_job_spec", recorder)
    assert ray_job.submit_train_job("h", RUN, environ={}, working_dir=None, resubmits=1, out=print).status == "FAILED"
    assert len(recorder.entrypoints) == 2
    stopped = Recorder("STOPPED")
    monkeypatch.setattr(ray_job, "submit_job_spec", stopped)  # a job the user stopped is not run again
    assert ray_job.submit_train_job("h", RUN, environ={}, working_dir=None, resubmits=3, out=print).status == "STOPPED"
    assert len(stopped.entrypoints) == 1
    plain = Recorder("FAILED")
    monkeypatch.setattr(ray_job, "submit_job_spec", plain)
    ray_job.submit_train_job("h", RUN, environ={}, working_dir=None, out=print)
    assert "--load" not in plain.entrypoints[0]  # without resubmits the command is the user's, unchanged


def test_cli_refuses_resubmit_where_it_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert ray_job.main(["--resubmit", "1", "--no-wait", *RUN]) == 2
    assert ray_job.main(["--resubmit", "1", "--preset", "tiny"]) == 2
    assert ray_job.main(["--resubmit", "1", "eval", "/ck"]) == 2
    err = capsys.readouterr().err
    assert "drop --no-wait" in err and "--output-dir" in err and "drop it for eval" in err


class DroppingClient:
    """A job client whose log stream breaks after the first chunk (as the dashboard's websocket did while a
    node died); the status and the whole log stay available."""

    def __init__(self, address: str, headers: Any = None) -> None:
        self.log = "step 0\nstep 1\nraygym: failed: the run failed: trainer rank 0 died\n"
        self.polls = 0

    def submit_job(self, **kwargs: Any) -> str:
        return "job-a"

    async def tail_job_logs(self, job_id: str) -> Any:
        yield "step 0\n"
        raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    def get_job_status(self, job_id: str) -> Any:
        self.polls += 1
        return type("Status", (), {"value": "RUNNING" if self.polls < 3 else "FAILED"})()

    def get_job_logs(self, job_id: str) -> str:
        return self.log

    def get_job_info(self, job_id: str) -> Any:
        return type("Info", (), {"message": "exit code 1"})()


def test_a_dropped_log_stream_is_followed_by_status_to_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", DroppingClient)
    monkeypatch.setattr(ray_job.time, "sleep", lambda s: None)
    said: list[str] = []
    spec = ray_job.build_job_spec(RUN, environ={}, working_dir=None)
    outcome = ray_job.submit_job_spec("http://head:8265", spec, environ={}, out=said.append)
    assert outcome.status == "FAILED"
    text = "\n".join(said)
    assert "log stream of job job-a closed" in text and "trainer rank 0 died" in text
    assert text.count("step 0") == 1  # what was shown is not shown twice
