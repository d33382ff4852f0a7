"""``raygym submit`` is ``python -m raygym.launchers.ray_job``: the same parser and submission, exit codes from the
job's outcome. The submission to the cluster is replaced by a recorder (what would be sent is checked);
tests/e2e/test_ray_job_submit.py and tests/wheel/test_submit_installed.py submit to a real Ray head."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

import raygym.launchers.ray_job as ray_job
from raygym.cli.main import main
from raygym.launchers import source

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--preset", "tiny", "--num-rollout", "3", "--output-dir", "/shared/runs/r1"]


class Recorder:
    """Stands in for ``submit_job_spec``: records each (address, spec, options) and answers with the next status."""

    def __init__(self, *statuses: str) -> None:
        self.statuses = list(statuses)
        self.calls: list[tuple[str, ray_job.JobSpec, dict[str, Any]]] = []

    def __call__(self, address: str, spec: ray_job.JobSpec, **kwargs: Any) -> ray_job.JobOutcome:
        self.calls.append((address, spec, kwargs))
        return ray_job.JobOutcome(f"job-{len(self.calls)}", self.statuses.pop(0))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder("SUCCEEDED")
    monkeypatch.setattr(ray_job, "submit_job_spec", rec)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return rec


def test_submit_sends_the_train_command_with_the_checkouts_working_dir(recorder: Recorder) -> None:
    assert main(["submit", "--address", "http://head:8265", "--", *TRAIN]) == 0
    address, spec, options = recorder.calls[0]
    assert address == "http://head:8265" and options["follow"] is True
    assert shlex.split(spec.entrypoint) == ["python", "-m", "raygym.train", *TRAIN]
    assert spec.runtime_env["working_dir"] == str(REPO)


def test_submit_from_an_install_uploads_the_current_directory(recorder: Recorder, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "http://from-env:8265")
    assert main(["submit", *TRAIN]) == 0  # no `--`: unknown flags are train flags as well
    address, spec, _ = recorder.calls[0]
    assert address == "http://from-env:8265" and spec.runtime_env["working_dir"] == str(tmp_path)


def test_installed_uploads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder("SUCCEEDED")
    monkeypatch.setattr(ray_job, "submit_job_spec", rec)
    assert main(["submit", "--address", "http://h:8265", "--installed", *TRAIN]) == 0
    assert "working_dir" not in rec.calls[0][1].runtime_env


def test_resubmit_resumes_a_failed_job_and_the_exit_code_follows_the_outcome(monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture) -> None:
    rec = Recorder("FAILED", "SUCCEEDED")
    monkeypatch.setattr(ray_job, "submit_job_spec", rec)
    assert main(["submit", "--address", "http://h:8265", "--resubmit", "1", *TRAIN]) == 0
    assert [shlex.split(c[1].entrypoint)[-2:] for c in rec.calls] == [["--load", "/shared/runs/r1/checkpoints"]] * 2
    failed = Recorder("FAILED")
    monkeypatch.setattr(ray_job, "submit_job_spec", failed)
    assert main(["submit", "--address", "http://h:8265", *TRAIN]) == 1
    assert "did not succeed" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--resubmit", "x", *TRAIN], "--resubmit: invalid int value"),
    (["--resubmit", "1", "--preset", "tiny"], "--output-dir"),  # a resubmitted run needs a fixed place
    ([*TRAIN, "--ray-auth-token", "abcdef"], "RAY_AUTH_TOKEN"),  # the token never travels on a command line
    (["eval"], "raygym submit eval CHECKPOINT"),
    (["--preset", "no-such-preset"], "no-such-preset"),  # checked before anything is submitted
])
def test_bad_input_exits_2_before_submitting(recorder: Recorder, capsys: pytest.CaptureFixture, argv: list[str],
                                             says: str) -> None:
    assert main(["submit", "--address", "http://h:8265", *argv]) == 2
    assert says in capsys.readouterr().err and recorder.calls == []


def test_help_lists_the_launcher_flags(capsys: pytest.CaptureFixture) -> None:
    assert main(["submit", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert out.startswith("usage: raygym submit") and "--resubmit N" in out and "never from the command line" in out
