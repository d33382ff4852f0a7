"""`raygym train` with a bad environment or task stops before Ray starts: exit code 2 and one line naming the field,
the value and the fix (the real command, in a subprocess): an unknown verifiers environment or OpenEnv server, an
unknown reasoning-gym task, a package that is not installed."""

from __future__ import annotations

import pytest
from test_cli_bad_input import assert_stopped_early, train


def test_unknown_verifiers_environment(tmp_path):
    done, elapsed = train(tmp_path, "--rollout-env", "verifiers:no-such-env", "--rm-type", "env")
    assert_stopped_early(done, elapsed, "rollout_env='verifiers:no-such-env'", "no module 'no_such_env'",
                         "install the environment's package")


def test_unknown_openenv_server(tmp_path):
    done, elapsed = train(tmp_path, "--rollout-env", "openenv:no_such_pkg.server:app", "--rm-type", "env")
    assert_stopped_early(done, elapsed, "rollout_env='openenv:no_such_pkg.server:app'", "cannot import")


def test_an_environment_that_raises_while_it_is_built(tmp_path):
    (tmp_path / "hub_env.py").write_text("def load_environment(**kw):\n    raise OSError('dataset not reachable')\n")
    done, elapsed = train(tmp_path, "--rollout-env", "verifiers:hub-env", "--rm-type", "env")
    assert_stopped_early(done, elapsed, "rollout_env='verifiers:hub-env'", "OSError: dataset not reachable")


def test_unknown_reasoning_gym_task(tmp_path):
    pytest.importorskip("reasoning_gym")
    done, elapsed = train(tmp_path, "--prompt-data", "reasoning-gym:letter_countin", "--rm-type", "reasoning_gym")
    assert_stopped_early(done, elapsed, "prompt_data='reasoning-gym:letter_countin'", "did you mean 'letter_counting'")


def test_a_package_that_is_not_installed_names_the_extra(tmp_path):
    stub = tmp_path / "verifiers"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('verifiers is not installed here')\n")
    done, elapsed = train(tmp_path, "--rollout-env", "verifiers:reverse-text", "--rm-type", "env")
    assert_stopped_early(done, elapsed, "pip install 'raygym[verifiers]'")
