"""Submit a raygym run to any running Ray cluster — ``ray job submit`` with the right runtime_env.

Equivalent to ``ray job submit --address ADDR --runtime-env-json ... -- python -m raygym.train FLAGS``, plus:
env vars from the recipe's ``environment`` / ``train_env_vars``; secrets (``WANDB_API_KEY``, ``HF_TOKEN``…)
copied from *your* environment into the job's runtime_env — never onto the command line — and redacted in
everything printed; the Ray auth token sent as an HTTP header when the cluster uses token auth.

CLI (``raygym submit`` runs the same :func:`main`; flags it does not know are train flags, forwarded verbatim)::

    raygym submit --address http://127.0.0.1:8265 --preset tiny --num-rollout 2
    python -m raygym.launchers.ray_job --address http://127.0.0.1:8265 eval /runs/r1 --prompt-data s3://b/t.jsonl

The second form runs ``raygym eval CHECKPOINT [eval flags]`` as the job (the checkpoint and the data must
be reachable from the cluster: shared storage or an fsspec URL).

The job's working_dir (uploaded with it) is the checkout when raygym runs from one, else the current directory
(see :mod:`raygym.launchers.source`); ``--installed`` uploads nothing and runs the raygym installed on the cluster.

Python::

    from raygym.launchers.ray_job import submit_train_job
    job = submit_train_job("http://head:8265", ["--preset", "qwen3-4b"], pip_extras=["wandb"])
    job.status   # 'SUCCEEDED' | 'FAILED' | 'STOPPED' | ...
    submit_eval_job("http://head:8265", "/shared/runs/r1", ["--n-samples-per-eval-prompt", "8"])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError
from raygym.launchers import source

if TYPE_CHECKING:
    from raygym.config import Recipe

REPO_ROOT = source.CHECKOUT_ROOT  # None when raygym is installed rather than checked out
# A job's working_dir by default: the checkout, else the caller's current directory ("." is resolved by Ray when
# it uploads the directory, so it is the directory of the call, not of the import).
DEFAULT_WORKING_DIR = str(REPO_ROOT) if REPO_ROOT is not None else "."
TRAIN_MODULE = "raygym.train"
EVAL_COMMAND = ("-m", "raygym", "eval")  # python -m raygym eval CHECKPOINT [flags]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Secrets copied from the caller's environment into the job's env_vars (never argv).
SECRET_ENV_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Flags that would put a secret on a command line; the fix is the matching env var.
_SECRET_FLAGS = {
    "--wandb-key": "WANDB_API_KEY",
    "--wandb-api-key": "WANDB_API_KEY",
    "--hf-token": "HF_TOKEN",
    "--ray-auth-token": "RAY_AUTH_TOKEN",
}
# Never uploaded with working_dir: build outputs, run outputs, caches.
WORKING_DIR_EXCLUDES = [
    ".git", "runs", "outputs", ".venv", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache",
    ".benchmarks", "wandb",
]  # fmt: skip
REDACTED = "***"
TERMINAL_STATUSES = {"SUCCEEDED", "FAILED", "STOPPED"}


# ---------------------------------------------------------------- train flags and the recipe


def resolve_recipe(train_args: Sequence[str]) -> Any:
    """The :class:`raygym.Recipe` a train command line describes (preset, TOML files, flags).

    Parsed exactly as the job will parse it (``raygym.run.config_loading.load_train_config``), so a bad flag fails here,
    before anything is submitted.
    """
    return resolve_config(train_args).recipe


def resolve_config(train_args: Sequence[str]) -> Any:
    """The :class:`raygym.TrainConfig` a train command line describes, parsed as the job will parse it."""
    from raygym.run.config_loading import load_train_config

    return load_train_config(list(train_args))


def recipe_env_vars(recipe: Recipe) -> dict[str, str]:
    """``recipe.environment`` then ``recipe.train_env_vars`` (the Recipe has parsed and checked both)."""
    return {**recipe.environment, **(recipe.train_env_vars or {})}


# ---------------------------------------------------------------- secrets


def secret_env_vars(environ: Mapping[str, str], names: Iterable[str] = SECRET_ENV_VARS) -> dict[str, str]:
    """The secrets set in ``environ`` (empty values skipped)."""
    return {n: environ[n] for n in names if environ.get(n)}


def check_no_secrets_on_argv(train_args: Sequence[str], secret_values: Iterable[str]) -> None:
    """Raise ``ConfigError`` when a train flag would carry a secret on the job's command line."""
    for arg in train_args:
        flag = arg.split("=", 1)[0]
        if flag in _SECRET_FLAGS:
            raise ConfigError(
                f"{flag}: secrets must not travel on the command line; export {_SECRET_FLAGS[flag]} "
                "in your environment instead (it is passed to the job through runtime_env env_vars)"
            )
    for value in secret_values:
        if len(value) >= 4 and any(value in arg for arg in train_args):
            raise ConfigError(
                "train flags contain the value of a secret env var; remove it from the command line — "
                f"the launcher passes {', '.join(SECRET_ENV_VARS)} through runtime_env env_vars"
            )


def redact(text: str, secret_values: Iterable[str]) -> str:
    """``text`` with every secret value replaced by ``***``.

    >>> redact("key=abcd1234 ok", ["abcd1234"])
    'key=*** ok'
    """
    for value in sorted((v for v in secret_values if len(v) >= 4), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def redacted_runtime_env(runtime_env: Mapping[str, Any], secret_names: Iterable[str]) -> dict[str, Any]:
    """A printable copy of ``runtime_env``: secret env var values replaced by ``***``."""
    names = set(secret_names)
    out = dict(runtime_env)
    if "env_vars" in out:
        out["env_vars"] = {k: (REDACTED if k in names else v) for k, v in out["env_vars"].items()}
    return out


# ---------------------------------------------------------------- Ray auth token


def find_auth_token(
    environ: Mapping[str, str], token_file: str | None = None, home: str | None = None
) -> str | None:
    """The Ray auth token to send, looked up like Ray 2.60 does; None when there is none to send.

    Order: ``token_file``; ``RAY_AUTH_TOKEN``; the file in ``RAY_AUTH_TOKEN_PATH``; ``~/.ray/auth_token``
    unless ``RAY_AUTH_MODE=disabled``.
    """
    if token_file:
        path = Path(token_file).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"auth_token_file={token_file!r}: no such file; point it at the cluster's token"
            )
        return path.read_text().strip() or None
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return environ["RAY_AUTH_TOKEN"].strip()
    if environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        if not path.is_file():
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH={str(path)!r}: no such file; fix or unset it")
        return path.read_text().strip() or None
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    default = Path(home or Path.home()) / ".ray" / "auth_token"
    if not default.is_file():
        return None
    return default.read_text().strip() or None


def auth_headers(token: str | None) -> dict[str, str]:
    """HTTP headers for the Ray dashboard (``Authorization: Bearer <token>``), {} without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


# ---------------------------------------------------------------- runtime_env and entrypoint


def pip_for_extras(extras: Iterable[str], pyproject: Path | None = None) -> list[str]:
    """The requirements of raygym's optional extras (``wandb`` → ``["wandb>=0.19"]``), from the checkout's
    pyproject.toml or the installed package's metadata (:func:`raygym.launchers.source.extra_requirements`)."""
    return source.extra_requirements(extras, pyproject)


def build_entrypoint(train_args: Sequence[str], python: str = "python") -> str:
    """The job's shell command: ``python -m raygym.train <flags>`` (quoted; never contains secrets)."""
    return shlex.join([python, "-m", TRAIN_MODULE, *train_args])


def build_runtime_env(
    recipe_env: Mapping[str, str],
    secrets: Mapping[str, str],
    *,
    working_dir: str | None,
    pip: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The job's runtime_env: env vars (recipe, then ``extra_env``, then secrets), working_dir, pip.

    ``working_dir=None`` runs the raygym already installed on the cluster.
    """
    env = {**recipe_env, **(extra_env or {}), **secrets}
    runtime_env: dict[str, Any] = {}
    if env:
        runtime_env["env_vars"] = env
    if working_dir is not None:
        runtime_env["working_dir"] = str(working_dir)
        runtime_env["excludes"] = list(WORKING_DIR_EXCLUDES)
    if pip:
        runtime_env["pip"] = list(pip)
    return runtime_env


@dataclass(frozen=True)
class JobSpec:
    """Everything sent to the cluster for one run (``entrypoint`` + ``runtime_env``)."""

    entrypoint: str
    runtime_env: dict[str, Any]
    secret_names: tuple[str, ...]

    def describe(self, address: str) -> str:
        """The equivalent ``ray job submit`` command, secrets redacted."""
        env = json.dumps(redacted_runtime_env(self.runtime_env, self.secret_names))
        return (
            f"ray job submit --address {address} --runtime-env-json {shlex.quote(env)} -- {self.entrypoint}"
        )


def build_job_spec(
    train_args: Sequence[str],
    *,
    environ: Mapping[str, str],
    recipe: Any | None = None,
    working_dir: str | None = DEFAULT_WORKING_DIR,
    pip_extras: Iterable[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> JobSpec:
    """Check the flags and build the entrypoint + runtime_env for ``train_args``.

    ``recipe`` defaults to :func:`resolve_recipe` of the flags (for its env vars).
    """
    train_args = list(train_args)
    secrets = secret_env_vars(environ)
    check_no_secrets_on_argv(train_args, secrets.values())
    recipe = resolve_recipe(train_args) if recipe is None else recipe
    runtime_env = build_runtime_env(
        recipe_env_vars(recipe), secrets, working_dir=working_dir, pip=pip_for_extras(pip_extras),
        extra_env=extra_env,
    )  # fmt: skip
    return JobSpec(build_entrypoint(train_args), runtime_env, tuple(secrets))


def build_eval_entrypoint(checkpoint: str, eval_args: Sequence[str], python: str = "python") -> str:
    """The eval job's shell command: ``python -m raygym eval CHECKPOINT <flags>`` (quoted)."""
    return shlex.join([python, *EVAL_COMMAND, checkpoint, *eval_args])


def build_eval_job_spec(
    checkpoint: str,
    eval_args: Sequence[str],
    *,
    environ: Mapping[str, str],
    working_dir: str | None = DEFAULT_WORKING_DIR,
    pip_extras: Iterable[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> JobSpec:
    """Check the flags and build the entrypoint + runtime_env of a ``raygym eval`` job.

    The eval reads the run's own config (engines get its ``environment``) on the cluster, so only the
    secrets and ``extra_env`` travel in the runtime_env here.
    """
    if not checkpoint or checkpoint.startswith("-"):
        raise ConfigError(f"eval checkpoint={checkpoint!r}: give the checkpoint first: eval CHECKPOINT [flags]")
    args = [checkpoint, *eval_args]
    secrets = secret_env_vars(environ)
    check_no_secrets_on_argv(args, secrets.values())
    runtime_env = build_runtime_env({}, secrets, working_dir=working_dir, pip=pip_for_extras(pip_extras),
                                    extra_env=extra_env)
    return JobSpec(build_eval_entrypoint(checkpoint, eval_args), runtime_env, tuple(secrets))


# ---------------------------------------------------------------- submit and follow


@dataclass(frozen=True)
class JobOutcome:
    """How a submitted job ended (or stood, with ``follow=False``)."""

    job_id: str
    status: str  # Ray JobStatus value: PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED
    message: str = ""

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"


def submit_train_job(
    address: str,
    train_args: Sequence[str],
    *,
    environ: Mapping[str, str] | None = None,
    recipe: Any | None = None,
    working_dir: str | None = DEFAULT_WORKING_DIR,
    pip_extras: Iterable[str] = (),
    extra_env: Mapping[str, str] | None = None,
    token_file: str | None = None,
    submission_id: str | None = None,
    follow: bool = True,
    out: Callable[[str], None] = print,
    watchdog: Callable[[], str | None] | None = None,
    watchdog_interval_s: float = 5.0,
    resubmits: int = 0,
) -> JobOutcome:
    """Submit ``python -m raygym.train <train_args>`` to the Ray cluster at ``address``.

    Prints the job id, then (``follow=True``) streams the job's logs until it ends and returns its final
    status. ``watchdog`` is polled every ``watchdog_interval_s`` while following: when it returns a text,
    the job is stopped and that text becomes the outcome's message (the Modal launcher uses it to fail a
    run whose node stayed dead).

    ``resubmits``: a job that FAILED (e.g. its trainer's node was lost) is submitted again, up to this many
    times; every submission loads the run's own checkpoints (:func:`resumable_args`), so a resubmitted run
    continues after its newest complete checkpoint. Its placement waits up to ``placement_timeout`` for the
    cluster to have the GPUs again.
    """
    environ = os.environ if environ is None else environ
    if resubmits < 0:
        raise ConfigError(f"resubmits={resubmits}: must be >= 0")
    if resubmits:
        if not follow:
            raise ConfigError("resubmits: a resubmitted job is followed to its end; drop --no-wait")
        train_args = resumable_args(train_args)
    spec = build_job_spec(
        train_args, environ=environ, recipe=recipe, working_dir=working_dir, pip_extras=pip_extras,
        extra_env=extra_env,
    )  # fmt: skip
    for attempt in range(resubmits + 1):
        outcome = submit_job_spec(address, spec, environ=environ, token_file=token_file,
                                  submission_id=submission_id if attempt == 0 else None, follow=follow, out=out,
                                  watchdog=watchdog, watchdog_interval_s=watchdog_interval_s)
        if outcome.status != "FAILED" or attempt == resubmits:
            return outcome
        out(f"job {outcome.job_id} failed; resubmitting it to resume from its checkpoints "
            f"(resubmission {attempt + 1} of {resubmits})")
    raise AssertionError("unreachable")


def resumable_args(train_args: Sequence[str]) -> list[str]:
    """``train_args`` with ``--load`` at the run's own checkpoint directory (kept when given), so that the same
    command, submitted again, resumes the run. The run needs a fixed place: ``--output-dir`` or ``--save``.

    >>> resumable_args(["--preset", "tiny", "--output-dir", "/shared/r1"])[-2:]
    ['--load', '/shared/r1/checkpoints']
    """
    args = list(train_args)
    if any(a == "--load" or a.startswith("--load=") for a in args):
        return args
    if not any(a.split("=", 1)[0] in ("--output-dir", "--save") for a in args):
        raise ConfigError("resubmits: give --output-dir (or --save) on shared storage, so that a resubmitted job "
                          "finds the checkpoints of the one before it; without it every run gets a new directory")
    return [*args, "--load", resolve_config(args).checkpoint_dir]


def submit_eval_job(
    address: str,
    checkpoint: str,
    eval_args: Sequence[str] = (),
    *,
    environ: Mapping[str, str] | None = None,
    working_dir: str | None = DEFAULT_WORKING_DIR,
    pip_extras: Iterable[str] = (),
    extra_env: Mapping[str, str] | None = None,
    token_file: str | None = None,
    submission_id: str | None = None,
    follow: bool = True,
    out: Callable[[str], None] = print,
) -> JobOutcome:
    """Submit ``python -m raygym eval CHECKPOINT <eval_args>`` to the Ray cluster at ``address`` (the job's
    engines run on the cluster; its outputs land in ``--out`` or ``<run>/eval/<checkpoint>``)."""
    environ = os.environ if environ is None else environ
    spec = build_eval_job_spec(checkpoint, eval_args, environ=environ, working_dir=working_dir,
                               pip_extras=pip_extras, extra_env=extra_env)
    return submit_job_spec(address, spec, environ=environ, token_file=token_file, submission_id=submission_id,
                           follow=follow, out=out)


def submit_job_spec(
    address: str,
    spec: JobSpec,
    *,
    environ: Mapping[str, str],
    token_file: str | None = None,
    submission_id: str | None = None,
    follow: bool = True,
    out: Callable[[str], None] = print,
    watchdog: Callable[[], str | None] | None = None,
    watchdog_interval_s: float = 5.0,
) -> JobOutcome:
    """Submit a built :class:`JobSpec` (auth header, redacted printing, optional log following)."""
    from ray.job_submission import JobSubmissionClient

    token = find_auth_token(environ, token_file)
    headers = auth_headers(token)
    env_vars = spec.runtime_env.get("env_vars", {})
    secret_values = [env_vars[n] for n in spec.secret_names] + ([token] if token else [])
    say = lambda text: out(redact(text, secret_values))  # noqa: E731

    client = JobSubmissionClient(address, headers=headers or None)
    say(f"submitting: {spec.describe(address)}")
    job_id = client.submit_job(
        entrypoint=spec.entrypoint, runtime_env=spec.runtime_env, submission_id=submission_id
    )
    say(f"job id: {job_id}")
    if not follow:
        return JobOutcome(job_id, str(client.get_job_status(job_id).value))

    stop_reason: list[str] = []
    done = threading.Event()
    if watchdog is not None:
        threading.Thread(
            target=_watch,
            args=(client, job_id, watchdog, watchdog_interval_s, done, stop_reason, say),
            daemon=True,
        ).start()
    shown = [0]  # characters of the job's log printed so far
    try:
        try:
            asyncio.run(_tail(client, job_id, say, shown))
            status = _wait_terminal(client, job_id)
        except RuntimeError as exc:  # the log stream dropped (a busy or restarted dashboard): poll instead
            say(f"the log stream of job {job_id} closed ({exc}); following its status")
            status = _wait_terminal(client, job_id, timeout_s=None)
            rest = str(client.get_job_logs(job_id))[shown[0]:]
            if rest:
                say(rest.rstrip("\n"))
    finally:
        done.set()
    info = client.get_job_info(job_id)
    message = stop_reason[0] if stop_reason else (info.message or "")
    say(f"job {job_id} ended: {status}" + (f" — {message}" if message else ""))
    return JobOutcome(job_id, status, message)


async def _tail(client: Any, job_id: str, say: Callable[[str], None], shown: list[int]) -> None:
    async for chunk in client.tail_job_logs(job_id):
        shown[0] += len(chunk)
        say(chunk.rstrip("\n"))


def _wait_terminal(client: Any, job_id: str, timeout_s: float | None = 60.0) -> str:
    """The job's status once it is final (or after ``timeout_s``; None: no limit)."""
    # The log stream can close a moment before the status is final.
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL_STATUSES or (deadline is not None and time.monotonic() > deadline):
            return status
        time.sleep(0.5)


def _watch(
    client: Any,
    job_id: str,
    watchdog: Callable[[], str | None],
    interval_s: float,
    done: threading.Event,
    stop_reason: list[str],
    say: Callable[[str], None],
) -> None:
    while not done.wait(interval_s):
        reason = watchdog()
        if reason:
            stop_reason.append(reason)
            say(f"watchdog: stopping job {job_id}:\n{reason}")
            client.stop_job(job_id)
            return


# ---------------------------------------------------------------- CLI


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Submit `python -m raygym.train [train flags]` (or, after the word `eval`, "
        "`raygym eval CHECKPOINT [eval flags]`) to a running Ray cluster and follow its logs until it ends. "
        "Flags not listed here are train (or eval) flags and are forwarded verbatim. The Ray auth token comes from "
        "the environment (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), never from the command line.",
        allow_abbrev=False,
        exit_on_error=False,
    )
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS,
                   help="Ray dashboard URL (default $RAY_ADDRESS or %(default)s)")  # fmt: skip
    p.add_argument("--working-dir", default=source.default_working_dir(),
                   help="uploaded as the job's working_dir (default: %(default)s: the checkout when raygym runs "
                        "from one, else the current directory)")
    p.add_argument("--installed", action="store_true",
                   help="upload no working_dir: run the raygym installed on the cluster")
    p.add_argument(
        "--pip-extra", action="append", default=[], help="raygym extra to pip-install (repeatable)"
    )
    p.add_argument("--submission-id", default=None)
    p.add_argument("--auth-token-file", default=None, help="Ray auth token file (default: RAY_AUTH_TOKEN…)")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.add_argument("--resubmit", type=int, default=0, metavar="N",
                   help="submit a failed job again, up to N times, resuming from its checkpoints (needs "
                        "--output-dir or --save on storage every node shares)")
    return p


def run_cli(argv: Sequence[str], prog: str = "python -m raygym.launchers.ray_job") -> bool:
    """Parse a launcher command line, submit its job and (unless ``--no-wait``) follow it to its end.

    Returns whether it went well: the job succeeded, or was submitted with ``--no-wait`` and has not failed.
    Bad flags raise ``ConfigError``; ``--help`` prints the help and raises ``SystemExit(0)``.
    """
    try:
        opts, train_args = _parser(prog).parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{prog}: {exc}") from None
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    common = {"working_dir": None if opts.installed else opts.working_dir, "pip_extras": opts.pip_extra,
              "token_file": opts.auth_token_file, "submission_id": opts.submission_id, "follow": not opts.no_wait}
    if train_args[:1] == ["eval"]:
        if len(train_args) < 2:
            raise ConfigError(f"eval: give the checkpoint: {prog} eval CHECKPOINT [flags]")
        if opts.resubmit:
            raise ConfigError("--resubmit: only training jobs resume from checkpoints; drop it for eval")
        outcome = submit_eval_job(opts.address, train_args[1], train_args[2:], **common)
    else:
        outcome = submit_train_job(opts.address, train_args, resubmits=opts.resubmit, **common)
    return outcome.succeeded or (opts.no_wait and outcome.status not in ("FAILED", "STOPPED"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m raygym.launchers.ray_job``: :func:`run_cli`; returns 0 when it went well, 1 when the job did
    not succeed, 2 for a usage error."""
    try:
        return 0 if run_cli(sys.argv[1:] if argv is None else argv) else 1
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
