"""``raygym submit``: a training (or eval) job on a running Ray cluster, through :mod:`raygym.launchers.ray_job`.

    raygym submit --address http://HEAD:8265 --preset qwen3-4b --num-rollout 100
    raygym submit --address http://HEAD:8265 --resubmit 2 -- @ run.toml --output-dir /shared/runs/r1
    raygym submit --address http://HEAD:8265 eval /shared/runs/r1 --prompt-data s3://bucket/test.jsonl

The same options and code path as ``python -m raygym.launchers.ray_job``: the launcher's flags first
(``--address``, default ``$RAY_ADDRESS``; ``--working-dir``; ``--installed``; ``--pip-extra``; ``--resubmit N``;
``--no-wait``; ``--auth-token-file``), every other flag a train flag. The Ray auth token comes from the
environment (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), never from the command line.
The job's logs are followed until it ends; the exit code is 0 when it succeeded, 1 when it did not, 2 for a
usage error. From an installed raygym the job's working_dir is the current directory (your TOML files and data).
"""

from __future__ import annotations

import click

from raygym.errors import RaygymError

PROG = "raygym submit"


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def submit(ctx: click.Context) -> None:
    """Submit a training job to a running Ray cluster (--address http://HEAD:8265) and follow its logs."""
    from raygym.launchers.ray_job import run_cli

    try:
        went_well = run_cli(ctx.args, prog=PROG)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help was printed
            return
        raise
    if not went_well:
        raise RaygymError("the job did not succeed; its status and logs are above")
