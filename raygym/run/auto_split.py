"""``auto_split``: the splits a recipe allows, the one its measured steps choose, and the recipe that runs it.

On CPU the split is of a node's cores (``cpu_engine_cores``: the engines' cores, the trainer ranks sharing the
rest, see :func:`raygym.cluster.cpu_threads.split_cores`); on GPUs it is of the run's GPUs between trainer and
engines (``actor_num_nodes`` x ``actor_num_gpus_per_node`` and ``rollout_num_gpus``, every candidate a recipe
that validates). The choice itself is :func:`raygym.cluster.split_choice.choose_split`. Pure (no Ray).

>>> from raygym.presets import tiny
>>> recipe = tiny().replace(fully_async=True, num_rollout=8, auto_split=True)
>>> allowed_splits(recipe, cuda=False, node_cores=4)
([(1, 3), (2, 2), (3, 1)], 'cores')
>>> current_split(recipe, cuda=False, node_cores=4)
(1, 3)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from raygym.cluster.split_choice import (
    MeasuredSplit,
    SplitChoice,
    choose_split,
    cpu_splits,
    measured_from_rows,
)
from raygym.config import Recipe
from raygym.errors import ConfigError


def current_split(recipe: Recipe, *, cuda: bool, node_cores: int) -> tuple[int, int]:
    """(engine devices, trainer devices) the recipe runs with."""
    if not cuda:
        return recipe.engine_cores, node_cores - recipe.engine_cores
    alloc = recipe.gpu_allocation()
    return alloc.rollout_gpus, alloc.actor_gpus


def _gpu_candidate(recipe: Recipe, nodes: int, per_node: int, engines: int) -> Recipe | None:
    try:
        candidate = recipe.replace(actor_num_nodes=nodes, actor_num_gpus_per_node=per_node, rollout_num_gpus=engines)
    except ConfigError:  # the batch sizes or the engine size do not divide this split
        return None
    return candidate


def gpu_split_recipes(recipe: Recipe) -> dict[tuple[int, int], Recipe]:
    """Every GPU split of the run's GPUs that validates, by (engine GPUs, trainer GPUs): whole nodes of
    ``actor_num_gpus_per_node`` GPUs for the trainer, and on one node any trainer size that divides the total."""
    alloc = recipe.gpu_allocation()
    total, per_node = alloc.actor_gpus + alloc.rollout_gpus, recipe.actor_num_gpus_per_node
    shapes = {(nodes, per_node) for nodes in range(1, total // per_node)}
    if recipe.actor_num_nodes == 1:
        shapes |= {(1, size) for size in range(1, total) if total % size == 0}
    out: dict[tuple[int, int], Recipe] = {}
    for nodes, size in sorted(shapes):
        candidate = _gpu_candidate(recipe, nodes, size, total - nodes * size)
        if candidate is not None:
            out[(total - nodes * size, nodes * size)] = candidate
    return out


def allowed_splits(recipe: Recipe, *, cuda: bool, node_cores: int) -> tuple[list[tuple[int, int]], str]:
    """The (engine devices, trainer devices) splits the recipe may run with, and their unit."""
    if not cuda:
        return cpu_splits(node_cores, recipe.actor_num_gpus_per_node), "cores"
    return sorted(gpu_split_recipes(recipe)), "GPUs"


def choose_for_run(recipe: Recipe, rows: Sequence[Mapping[str, Any]], *, cuda: bool, node_cores: int
                   ) -> SplitChoice:
    """The split the measured ``rows`` (a run's metrics, which ran with ``recipe``'s split) choose."""
    engines, trainer = current_split(recipe, cuda=cuda, node_cores=node_cores)
    measured: MeasuredSplit = measured_from_rows(rows, engines, trainer)
    allowed, unit = allowed_splits(recipe, cuda=cuda, node_cores=node_cores)
    if not allowed:
        raise ConfigError(f"auto_split=True: no split of {node_cores} cores gives each of the "
                          f"{recipe.actor_num_gpus_per_node} trainer ranks and the engines a core of their own; "
                          "pass --no-auto-split")
    return choose_split(measured, allowed, unit=unit)


def apply_split(recipe: Recipe, choice: SplitChoice, *, cuda: bool) -> Recipe:
    """The recipe running ``choice``.

    >>> from raygym.cluster.split_choice import MeasuredSplit, choose_split
    >>> from raygym.presets import tiny
    >>> m = MeasuredSplit(engine_devices=1, trainer_devices=3, rollout_s=3.0, train_s=0.5, steps=4)
    >>> apply_split(tiny().replace(async_mode=True), choose_split(m, [(1, 3), (2, 2), (3, 1)], unit="cores"),
    ...             cuda=False).cpu_engine_cores
    2
    """
    if not cuda:
        return recipe.replace(cpu_engine_cores=choice.engine_devices)
    return gpu_split_recipes(recipe)[(choice.engine_devices, choice.trainer_devices)]
