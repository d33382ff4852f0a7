"""Pure parts of raygym.launchers.ray_job: the job's command line, runtime_env, secrets and auth token."""

from __future__ import annotations

import json
import shlex

import pytest

from raygym.config import Recipe
from raygym.errors import ConfigError
from raygym.launchers.ray_job import (
    REDACTED,
    REPO_ROOT,
    auth_headers,
    build_entrypoint,
    build_job_spec,
    build_runtime_env,
    check_no_secrets_on_argv,
    find_auth_token,
    pip_for_extras,
    recipe_env_vars,
    redact,
    resolve_recipe,
)

SECRETS = {"WANDB_API_KEY": "wandb-abc-123456", "HF_TOKEN": "hf_zyx987654"}


def _recipe(environment=None, train_env_vars=None):
    return Recipe(environment=environment or {}, train_env_vars=train_env_vars)


def test_entrypoint_is_the_train_module_with_flags_quoted():
    cmd = build_entrypoint(["--preset", "tiny", "--environment", '{"A": "x y"}'])
    assert shlex.split(cmd) == [
        "python",
        "-m",
        "raygym.train",
        "--preset",
        "tiny",
        "--environment",
        '{"A": "x y"}',
    ]


def test_recipe_env_vars_merge_environment_then_train_env_vars_json():
    env = recipe_env_vars(_recipe({"NCCL_DEBUG": "WARN", "N": "1"}, '{"NCCL_DEBUG": "INFO", "X": "y"}'))
    assert env == {"NCCL_DEBUG": "INFO", "N": "1", "X": "y"}


def test_bad_train_env_vars_json_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="train_env_vars"):
        recipe_env_vars(_recipe(train_env_vars="{not json"))


def test_runtime_env_working_dir_mode_and_installed_mode():
    with_dir = build_runtime_env({"A": "1"}, SECRETS, working_dir="/repo", pip=["wandb>=0.19"])
    assert with_dir["working_dir"] == "/repo" and ".git" in with_dir["excludes"]
    assert with_dir["env_vars"] == {"A": "1", **SECRETS}
    assert with_dir["pip"] == ["wandb>=0.19"]
    installed = build_runtime_env({}, {}, working_dir=None)
    assert installed == {}


def test_pip_for_extras_reads_pyproject_and_rejects_unknown():
    reqs = pip_for_extras(["wandb", "tensorboard"])
    assert any(r.startswith("wandb") for r in reqs) and any(r.startswith("tensorboard") for r in reqs)
    with pytest.raises(ConfigError, match="pip_extras='nope'.*known"):
        pip_for_extras(["nope"])


def test_job_spec_secrets_go_to_env_vars_never_to_the_command_line():
    environ = {**SECRETS, "PATH": "/bin", "UNRELATED": "z"}
    spec = build_job_spec(["--preset", "tiny"], environ=environ, recipe=_recipe({"A": "1"}))
    assert spec.runtime_env["env_vars"] == {"A": "1", **SECRETS}
    assert "UNRELATED" not in spec.runtime_env["env_vars"]
    for value in SECRETS.values():
        assert value not in spec.entrypoint
        assert value not in spec.describe("http://h:8265")
    described = spec.describe("http://h:8265")
    assert described.startswith("ray job submit --address http://h:8265 --runtime-env-json ")
    env_json = json.loads(shlex.split(described)[6])
    assert env_json["env_vars"]["WANDB_API_KEY"] == REDACTED and env_json["env_vars"]["A"] == "1"
    assert spec.runtime_env["working_dir"] == str(REPO_ROOT)


@pytest.mark.parametrize("flag", ["--wandb-key", "--wandb-api-key=abc", "--hf-token"])
def test_secret_flags_are_refused(flag):
    with pytest.raises(ConfigError, match="environment"):
        check_no_secrets_on_argv(["--preset", "tiny", flag, "v"], [])


def test_secret_value_on_argv_is_refused():
    with pytest.raises(ConfigError, match="secret"):
        check_no_secrets_on_argv(["--wandb-project", SECRETS["HF_TOKEN"]], SECRETS.values())


def test_redact_replaces_every_secret_value():
    text = f"a {SECRETS['WANDB_API_KEY']} b {SECRETS['HF_TOKEN']}{SECRETS['HF_TOKEN']}"
    out = redact(text, SECRETS.values())
    assert out == f"a {REDACTED} b {REDACTED}{REDACTED}"


def test_auth_token_lookup_order(tmp_path):
    token_file = tmp_path / "tok"
    token_file.write_text("from-file\n")
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("from-home")
    assert find_auth_token({"RAY_AUTH_TOKEN": "env"}, str(token_file), str(home)) == "from-file"
    assert find_auth_token({"RAY_AUTH_TOKEN": "env"}, None, str(home)) == "env"
    assert find_auth_token({"RAY_AUTH_TOKEN_PATH": str(token_file)}, None, str(home)) == "from-file"
    assert find_auth_token({}, None, str(home)) == "from-home"
    assert find_auth_token({"RAY_AUTH_MODE": "disabled"}, None, str(home)) is None
    assert find_auth_token({}, None, str(tmp_path / "nohome")) is None
    with pytest.raises(ConfigError, match="auth_token_file"):
        find_auth_token({}, str(tmp_path / "missing"), str(home))
    assert auth_headers("t0k") == {"Authorization": "Bearer t0k"} and auth_headers(None) == {}


def test_resolve_recipe_parses_like_the_job():
    recipe = resolve_recipe(["--preset", "tiny", "--num-rollout", "3", "--train-env-vars", '{"X": "1"}'])
    assert recipe.num_rollout == 3
    assert recipe_env_vars(recipe)["X"] == "1"
    with pytest.raises(ConfigError):
        resolve_recipe(["--preset", "no-such-preset"])
