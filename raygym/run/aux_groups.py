"""The run's auxiliary model groups, each on GPUs of its own: the LLM judge's engines and the
distillation teacher's scoring actors.

Each group gets its own placement group (``judge_num_engines x judge_num_gpus_per_engine`` or
``distill_num_gpus`` bundles of one GPU, probed and sorted like the main placement, an engine's GPUs on
one node), so on a cluster the judge and the teacher land beside the trainers and rollout engines
without sharing their GPUs; on CPU they get logical GPUs like everything else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.config.allocation import compute_allocation
from raygym.errors import ConfigError

if TYPE_CHECKING:
    from raygym.config import Recipe

logger = logging.getLogger(__name__)


def _allocation(total: int, per_engine: int, gpus_per_node: int, what: str) -> Any:
    if total <= gpus_per_node:
        nodes, per_node = 1, total
    elif total % gpus_per_node == 0:
        nodes, per_node = total // gpus_per_node, gpus_per_node
    else:
        raise ConfigError(f"{what}: {total} GPUs are not whole nodes of actor_num_gpus_per_node={gpus_per_node}; "
                          f"use at most {gpus_per_node} or a multiple of it")
    return compute_allocation(actor_num_nodes=nodes, actor_num_gpus_per_node=per_node, colocate=True,
                              rollout_num_gpus=total, rollout_num_gpus_per_engine=per_engine)


def _place(total: int, per_engine: int, recipe: Recipe, what: str) -> Any:
    from raygym.cluster.placement import allocate

    alloc = _allocation(total, per_engine, recipe.actor_num_gpus_per_node, what)
    # Nothing else runs in these bundles: each engine/actor takes the whole GPU share it is given.
    return allocate(alloc, trainer_share=0.5, engine_share=0.5, timeout=recipe.placement_timeout,
                    name=what).ensure_ready()


JUDGE_LABEL_TOKENS = 256  # room for the label the template may quote, beside the prompt and the response


def judge_engine_recipe(recipe: Recipe, engine_kind: str) -> Recipe:
    """The recipe the judge's engines start from: their GPUs, a batch of judge prompts at once, and on vLLM (which
    holds a context of fixed length) room for the longest judge prompt (the template around the longest prompt,
    response and label) and the judge's answer.

    >>> from raygym.config import Recipe
    >>> from raygym.engines.launch.vllm import max_model_len
    >>> judge = judge_engine_recipe(Recipe(rollout_max_prompt_len=64, rollout_max_response_len=32,
    ...                                    judge_prompt_template="{prompt} {response} {label}?", eval_interval=None),
    ...                             "vllm")
    >>> max_model_len(judge) == 64 + 32 + len("{prompt} {response} {label}?") + JUDGE_LABEL_TOKENS + 16
    True
    """
    settings = recipe.replace(rollout_num_gpus_per_engine=recipe.judge_num_gpus_per_engine,
                              sglang_max_running_requests=max(64, recipe.judge_batch_size))
    if engine_kind != "vllm":
        return settings
    response = max(recipe.rollout_max_response_len, recipe.eval_max_response_len if recipe.eval_interval else 0)
    prompt = ((recipe.rollout_max_prompt_len or 1024) + response + len(recipe.judge_prompt_template)
              + JUDGE_LABEL_TOKENS)
    return settings.replace(rollout_max_prompt_len=prompt, rollout_max_response_len=recipe.judge_max_response_len,
                            eval_interval=None)


def preflight_judge(recipe: Recipe, engine_kind: str, cache_dir: Path) -> None:
    """Before Ray starts: the judge model runs on the judge's engine kind here (on a machine without CUDA, vLLM's
    CPU attention takes its head size). ConfigError names the fix."""
    if not recipe.judge_hf_checkpoint or engine_kind != "vllm":
        return
    import torch

    if torch.cuda.is_available():
        return
    from raygym.builtin import resolve_model_path
    from raygym.engines.launch.vllm import check_cpu_head_dim, checkpoint_head_dim

    path = resolve_model_path(recipe.judge_hf_checkpoint, cache_dir)
    check_cpu_head_dim(checkpoint_head_dim(path), recipe.judge_hf_checkpoint,
                       "judge_hf_checkpoint with rollout_engine='vllm'")


@dataclass
class AuxGroups:
    """Handles of the judge and teacher groups (None when the recipe has none); ``shutdown()`` ends them."""

    judge_engines: Any = None  # raygym.cluster.actor_group.ActorGroup of EngineActor
    teacher_actors: Any = None  # ActorGroup of raygym.rewards.distill.TeacherActor
    placements: list[Any] = field(default_factory=list)

    def shutdown(self) -> None:
        import ray

        if self.judge_engines is not None:
            try:
                ray.get([h.shutdown.remote() for h in self.judge_engines.handles], timeout=60)
            except Exception as exc:  # keep tearing down
                logger.debug("judge engine shutdown failed: %s", exc)
        for group in (self.judge_engines, self.teacher_actors):
            if group is not None:
                group.kill()
        for placement in self.placements:
            placement.release()
        self.judge_engines = self.teacher_actors = None
        self.placements = []


def start_aux_groups(recipe: Recipe, run_dir: Path, engine_kind: str, say: Any = print) -> AuxGroups:
    """Start the judge engines and the teacher actors the recipe asks for; on failure, end what started."""
    import ray

    from raygym.builtin import resolve_model_path
    from raygym.cluster.actor_group import ActorGroup, merge_user_env, start_engine_group
    from raygym.engine_api.auth import engine_api_key

    groups = AuxGroups()
    try:
        if recipe.judge_hf_checkpoint:
            from raygym.engines.actor import EngineActor

            placement = _place(recipe.judge_num_engines * recipe.judge_num_gpus_per_engine,
                               recipe.judge_num_gpus_per_engine, recipe, "raygym-judge")
            groups.placements.append(placement)
            judge_path = resolve_model_path(recipe.judge_hf_checkpoint, run_dir / "cache")
            settings = judge_engine_recipe(recipe, engine_kind)
            groups.judge_engines = start_engine_group(
                placement, EngineActor, args=(settings,),
                kwargs={"model_path": judge_path, "backend": engine_kind, "log_dir": str(run_dir / "logs" / "judge")},
                environment=recipe.environment)
            say(f"starting {len(groups.judge_engines)} judge engine(s) ({recipe.judge_hf_checkpoint}) ...")
            key = engine_api_key()
            if key:
                ray.get([h.use_engine_api_key.remote(key) for h in groups.judge_engines.handles])
            ray.get([h.start.remote() for h in groups.judge_engines.handles])
        if recipe.distill_teacher_checkpoint:
            from raygym.rewards.distill import TeacherActor

            placement = _place(recipe.distill_num_gpus, 1, recipe, "raygym-teacher")
            groups.placements.append(placement)
            teacher_path = resolve_model_path(recipe.distill_teacher_checkpoint, run_dir / "cache")
            bundles = [engine[0] for engine in placement.engine_bundles]
            groups.teacher_actors = ActorGroup.start(
                TeacherActor, bundles, args=(teacher_path,), user_env=merge_user_env(recipe.environment),
                torchrun_env=False)
            say(f"starting {len(groups.teacher_actors)} teacher actor(s) ({recipe.distill_teacher_checkpoint}) ...")
            ray.get([h.ready.remote() for h in groups.teacher_actors.handles])
        return groups
    except BaseException:
        groups.shutdown()
        raise


def aux_manager_kwargs(recipe: Recipe, groups: AuxGroups, run_dir: Path) -> dict[str, Any]:
    """The rollout manager's ``judge`` / ``teacher`` arguments for the started groups."""
    out: dict[str, Any] = {}
    if groups.judge_engines is not None:
        from transformers import AutoTokenizer

        from raygym.builtin import resolve_model_path
        from raygym.rewards.judge import JudgeClient, JudgeSettings

        assert recipe.judge_hf_checkpoint  # the judge engines start only when it is set
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(recipe.judge_hf_checkpoint, run_dir / "cache"))
        out["judge"] = JudgeClient(JudgeSettings.from_recipe(recipe), tokenizer, engines=groups.judge_engines.handles)
    if groups.teacher_actors is not None:
        from raygym.rewards.distill import TeacherScorer

        out["teacher"] = TeacherScorer(groups.teacher_actors.handles, temperature=recipe.rollout_temperature)
    return out
