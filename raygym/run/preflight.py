"""Everything a run can check before it asks Ray for anything, in seconds: the data, the reward
functions, the model path, and that the run and checkpoint directories can be written.

Each problem is a :class:`ConfigError` naming the field, the value and the fix; ``raygym train``
prints it and exits with code 2. No torch, no ray.

>>> from raygym.run.config_loading import load_train_config
>>> facts = preflight(load_train_config(["--output-dir", __import__("tempfile").mkdtemp()]))
>>> facts.data.rows, [f.name for f in facts.rewards]
(1024, ['next_digit'])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.data.check import DataSummary, check_prompt_data, is_local
from raygym.errors import ConfigError
from raygym.run.vision_checks import check_vision_model, check_vision_run

if TYPE_CHECKING:
    from raygym.config import TrainConfig


@dataclass
class RunFacts:
    """What the checks found: the training data, the eval data (by name) and the reward functions."""

    data: DataSummary
    eval_data: dict[str, DataSummary] = field(default_factory=dict)
    rewards: list[Any] = field(default_factory=list)  # raygym.rewards.scoring.RewardFunction


def _check_dataset(url: str, cfg: TrainConfig, field_name: str) -> DataSummary:
    from raygym.builtin import BUILTIN_TASKS, EVAL_ROWS, NEXT_DIGIT_ROWS, is_builtin, split_task, unknown_task
    from raygym.vision.dataset import image_column

    ds = cfg.dataset
    image_key = image_column(cfg.recipe.multimodal_keys)
    if is_builtin(url):
        task, held_out = split_task(url)
        if task not in BUILTIN_TASKS:
            raise unknown_task(url, field_name)
        if image_key:  # the rows and their images, as the rollout will load them
            from raygym.data.prompts import resolve_data_url

            summary = check_prompt_data(resolve_data_url(url), input_key=ds.input_key, label_key=ds.label_key,
                                        fmt="jsonl", apply_chat_template=ds.apply_chat_template, field=field_name,
                                        image_key=image_key)
            return DataSummary(url, summary.rows, True, summary.columns)
        return DataSummary(url, EVAL_ROWS if held_out else NEXT_DIGIT_ROWS, True, ("prompt", "label"))
    generated = _check_generated_dataset(url, cfg, field_name)
    if generated is not None:
        return generated
    return check_prompt_data(url, input_key=ds.input_key, label_key=ds.label_key, fmt=ds.format,
                             apply_chat_template=ds.apply_chat_template, field=field_name, image_key=image_key)


def _check_generated_dataset(url: str, cfg: TrainConfig, field_name: str) -> DataSummary | None:
    """``reasoning-gym:<task>`` and ``verifiers:<env>`` data: the package, the task or environment, its rows."""
    from raygym.envs.reasoning_gym_tasks import check_task, is_task_uri
    from raygym.envs.specs import parse_env_spec

    columns = ("prompt", "label", "metadata")
    if is_task_uri(url):
        return DataSummary(url, check_task(url, field_name).size, True, columns)
    spec = parse_env_spec(url, field_name)
    if spec is None:
        return None
    if spec.scheme != "verifiers":
        raise ConfigError(f"{field_name}={url!r}: an OpenEnv environment is no dataset; pass it as --rollout-env and "
                          "give rows to start its episodes from")
    from raygym.envs.verifiers_env import environment_rows, load_environment

    rows = environment_rows(load_environment(spec, field_name), spec.split)
    if not rows:
        raise ConfigError(f"{field_name}={url!r}: the environment's {spec.split} dataset is empty")
    if isinstance(rows[0]["prompt"], list) and not cfg.dataset.apply_chat_template:
        raise ConfigError(f"{field_name}={url!r}: the environment's prompts are chat messages; pass "
                          "--apply-chat-template (the model's chat template renders them)")
    return DataSummary(url, len(rows), True, columns)


def check_rollout_env(cfg: TrainConfig) -> None:
    """``rollout_env`` loads: a verifiers environment is built, an OpenEnv target imported and classified, an
    import path imported (no server is started here)."""
    from raygym.callables import load_callable
    from raygym.envs.specs import parse_env_spec

    value = cfg.recipe.rollout_env
    spec = parse_env_spec(value)
    if spec is None:
        load_callable(value, "rollout_env")
    elif spec.scheme == "verifiers":
        from raygym.envs.verifiers_env import load_environment

        load_environment(spec)
    else:
        from raygym.envs.openenv_server import resolve_target

        target = resolve_target(spec.target, spec.attr)
        sessions = spec.options.get("sessions", 1)
        if target.app is None and not target.concurrent and sessions > 1:
            raise ConfigError(f"rollout_env={value!r}: sessions={sessions}, but {target.factory.__name__} does not "
                              "declare SUPPORTS_CONCURRENT_SESSIONS; use servers=<n> for episodes in parallel")


def check_rewards(cfg: TrainConfig, data: DataSummary) -> list[Any]:
    """Resolve the run's reward functions (importing custom ones and reading their signatures), refuse
    a builtin task's reward on other data, and check that TRL-style functions get every column they
    require."""
    from raygym.builtin import BUILTIN_TASKS
    from raygym.config import RM_TYPES, TASK_RM_TYPES
    from raygym.envs.reasoning_gym_tasks import check_rows_scorable, is_task_uri
    from raygym.rewards.scoring import default_rm_type, resolve_reward_functions, rm_type_choices
    from raygym.rewards.signatures import missing_inputs

    recipe = cfg.recipe
    prompt_data = cfg.dataset.prompt_data
    rm_type = default_rm_type(recipe, prompt_data)
    custom = recipe.custom_rm_function or recipe.reward_functions
    task_of_reward = {reward: task for task, reward in BUILTIN_TASKS.items()}
    task = task_of_reward.get(rm_type or "")
    if task is not None and not custom and prompt_data != task:
        own = BUILTIN_TASKS.get(prompt_data) or ("reasoning_gym" if is_task_uri(prompt_data) else None)
        others = ", ".join(repr(name) for name in RM_TYPES if name not in task_of_reward)
        raise ConfigError(
            f"rm_type={rm_type!r} scores the builtin {task.removeprefix('builtin:')} task"
            f"{' (the tiny preset sets it)' if rm_type == 'next_digit' else ''}, but prompt_data={prompt_data!r} "
            f"is other data; pass --rm-type {own if own else f'with one of {others}'} "
            "(or --custom-rm-function pkg.module:function)"
        )
    if (rm_type in TASK_RM_TYPES or (rm_type is None and recipe.rollout_env is not None)) and not custom:
        return []  # the rollout task scores: the judge engines or the environment's episode reward
    if rm_type is None and not custom:
        raise ConfigError(
            f"prompt_data={prompt_data!r} has no reward: pass --rm-type with one of {rm_type_choices()}, "
            "or --custom-rm-function pkg.module:function"
        )
    functions = resolve_reward_functions(rm_type, recipe.custom_rm_function, recipe.reward_functions)
    local_file = is_local(prompt_data) and os.path.isfile(prompt_data.removeprefix("file://"))
    if any(f.name == "reasoning_gym" for f in functions) and local_file:
        check_rows_scorable(prompt_data)
    from raygym.vision.dataset import image_column

    images = image_column(recipe.multimodal_keys)  # the rows' images travel apart from their columns
    columns = [c for c in data.columns if c not in (cfg.dataset.input_key, images)]
    for f in functions:
        missing = missing_inputs(f.fn, f.convention, columns)
        if missing:
            raise ConfigError(
                f"reward function {f.name!r} ({f.source}) takes {', '.join(map(repr, missing))} but prompt_data="
                f"{prompt_data!r} has no such column (its columns: {', '.join(sorted(data.columns))}); rename the "
                "parameter to a column, give it a default, or point --label-key/--input-key at other columns"
            )
    return functions


def check_writable(url: str, field_name: str, fix: str) -> None:
    """Create the local directory ``url`` if needed and write a probe file there (remote URLs are not
    probed); ConfigError naming ``field_name`` and ``fix`` when that fails."""
    if not is_local(url):
        return
    path = Path(url.removeprefix("file://"))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".raygym-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{field_name}={url!r}: cannot write there ({type(exc).__name__}: {reason}); {fix}") from None


def check_model_path(hf_checkpoint: str) -> None:
    """A checkpoint written as a local path (``/``, ``./``, ``~``, ``file://``) must exist."""
    if not hf_checkpoint.startswith(("/", "./", "../", "~", "file://")):
        return  # a Hub id, a builtin: or a remote URL
    path = os.path.expanduser(hf_checkpoint.removeprefix("file://"))
    if not os.path.exists(path):
        raise ConfigError(f"hf_checkpoint={hf_checkpoint!r}: no such directory; pass --hf-checkpoint with a model "
                          "directory, a Hub id or 'builtin:tiny-qwen3'")


def preflight(cfg: TrainConfig) -> RunFacts:
    """Check ``cfg`` (a :class:`raygym.TrainConfig`) as far as possible without Ray: data, eval data,
    rewards, model path, then the run and checkpoint directories (created here, as the run would)."""
    from raygym.data.prompts import eval_dataset_urls

    check_vision_model(cfg.recipe.multimodal_keys, cfg.model.hf_checkpoint)  # images need a vision checkpoint
    data = _check_dataset(cfg.dataset.prompt_data, cfg, "prompt_data")
    evals = {name: _check_dataset(url, cfg, f"eval_prompt_data[{name!r}]")
             for name, url in eval_dataset_urls(cfg).items()}
    rewards = check_rewards(cfg, data)
    if cfg.recipe.rollout_env is not None:
        check_rollout_env(cfg)
    check_model_path(cfg.model.hf_checkpoint)
    check_vision_run(cfg)
    check_writable(cfg.run_dir, "output_dir", "pass --output-dir with a directory you can write")
    if cfg.recipe.save:
        check_writable(cfg.checkpoint_dir, "save",
                       f"pass --save '' to keep checkpoints in the run directory ({cfg.run_dir}/checkpoints), "
                       "or --save with a directory you can write")
    return RunFacts(data, evals, rewards)
