"""What the rollout manager adds for environments, the LLM judge and distillation.

Kept apart from :mod:`raygym.rollout.manager` so that the manager only calls these few functions:
the episode runner of ``rollout_env``, the reward model of an environment or judge run, per-sample
metrics, and the teacher's scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raygym.callables import load_callable
from raygym.errors import ConfigError
from raygym.rewards.scoring import RewardModel
from raygym.types import Sample

if TYPE_CHECKING:
    from raygym.config.run import TrainConfig
    from raygym.rollout.settings import RolloutSettings


def episode_runner(settings: RolloutSettings, tokenizer: Any, custom_generate: Any,
                   chat_template_kwargs: dict[str, Any] | None = None) -> Any:
    """The episode runner of ``rollout_env`` (else ``custom_generate``): an :class:`raygym.envs.EpisodeRunner`
    over a raygym environment or an OpenEnv one (``openenv:...``, its servers started here), or a
    :class:`raygym.envs.verifiers_env.VerifiersRunner` (``verifiers:...``)."""
    from raygym.envs.specs import parse_env_spec

    spec = parse_env_spec(settings.rollout_env)
    factory = None if spec is not None else load_callable(settings.rollout_env, "rollout_env")
    if factory is None and spec is None:
        return custom_generate
    if custom_generate is not None:
        raise ConfigError("rollout_env and custom_generate_function are both set: an environment run generates "
                          "its episodes itself; keep one of them")
    from raygym.envs.runner import EpisodeRunner

    max_turns, max_context_len = settings.rollout_env_max_turns, settings.rollout_env_max_context_len
    if spec is not None and spec.scheme == "verifiers":
        from raygym.envs.verifiers_env import VerifiersRunner

        return VerifiersRunner(spec, tokenizer, chat_template_kwargs=chat_template_kwargs, max_turns=max_turns,
                               max_context_len=max_context_len)
    if spec is not None:
        from raygym.envs.openenv_env import OpenEnvPool

        factory = OpenEnvPool(spec)
    assert factory is not None
    return EpisodeRunner(factory, tokenizer, max_turns=max_turns, max_context_len=max_context_len)


async def close_episode_runner(runner: Any) -> None:
    """End what an episode runner started (an OpenEnv run's server processes)."""
    from raygym.envs.openenv_env import OpenEnvPool
    from raygym.envs.runner import EpisodeRunner
    from raygym.envs.verifiers_env import VerifiersRunner

    if isinstance(runner, EpisodeRunner) and isinstance(runner.env_factory, OpenEnvPool):
        await runner.env_factory.aclose()
    elif isinstance(runner, VerifiersRunner):
        runner.close()


def task_reward_model(cfg: TrainConfig, judge: Any, runner: Any = None) -> RewardModel | None:
    """The reward model of a judge run (``rm_type='judge'``) or of an environment run (``rm_type='env'``,
    or unset, with ``rollout_env``: the episode's reward; a verifiers environment's rubric, per group, for
    ``runner``, a :class:`raygym.envs.verifiers_env.VerifiersRunner`); None = the usual
    :func:`raygym.rewards.scoring.reward_model_from_config` (with ``rollout_env`` and another ``rm_type`` that
    verifier scores the episode's whole response text)."""
    recipe = cfg.recipe
    post = recipe.custom_reward_post_process_function
    if recipe.rm_type == "judge" and recipe.custom_rm_function is None:
        if judge is None:
            raise ConfigError("rm_type='judge' but no judge engines were started; set judge_hf_checkpoint")
        return RewardModel(None, judge.score_samples, post)
    if recipe.rm_type == "env" and recipe.rollout_env is None:
        raise ConfigError("rm_type='env' rewards environment episodes; set rollout_env too (or another rm_type)")
    if recipe.rollout_env is not None and recipe.custom_rm_function is None and recipe.rm_type in (None, "env"):
        from raygym.envs.runner import episode_reward
        from raygym.envs.verifiers_env import VerifiersRunner

        if isinstance(runner, VerifiersRunner):
            return RewardModel(None, runner.verifiers_rubric, post)
        return RewardModel(None, episode_reward, post)
    return None


def sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``rollout/<name>``: the mean of each per-sample metric over the samples that report it, and the
    mean reverse KL to the teacher (``rollout/distill_reverse_kl``, per trained token) when samples carry
    teacher log-probs."""
    out: dict[str, float] = {}
    for name in sorted({k for s in samples for k in s.metrics}):
        values = [s.metrics[name] for s in samples if name in s.metrics]
        out[f"rollout/{name}"] = sum(values) / len(values)
    scored = [(s, s.teacher_log_probs) for s in samples if s.teacher_log_probs is not None and s.rollout_log_probs]
    if scored:
        from raygym.rewards.distill import reverse_kl_per_token

        total = tokens = 0.0
        for s, teacher in scored:
            kl = reverse_kl_per_token(s.rollout_log_probs, teacher, s.effective_loss_mask())
            total += sum(kl)
            tokens += sum(s.effective_loss_mask())
        out["rollout/distill_reverse_kl"] = total / max(tokens, 1.0)
    return out
