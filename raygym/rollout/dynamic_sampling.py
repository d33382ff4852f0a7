"""Dynamic sampling (DAPO) for the synchronous loop: rounds of groups until ``rollout_batch_size`` pass the
filter (``dynamic_sampling_filter_path``); see :mod:`raygym.rollout.manager`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from raygym.data.prompts import PromptDataset, PromptRow
from raygym.engines.health import EnginePool
from raygym.errors import RaygymError
from raygym.rollout.filters import GroupFilter
from raygym.rollout.settings import RolloutSettings
from raygym.types import Sample


class RoundSource(Protocol):
    """What dynamic sampling uses of the rollout manager."""

    settings: RolloutSettings
    dataset: PromptDataset
    group_filter: GroupFilter | None
    pool: EnginePool
    max_sampling_rounds: int

    def reserve_group_keys(self, count: int) -> int: ...

    @property
    def generates_per_sample(self) -> bool: ...

    async def generate_round(self, rows: Sequence[PromptRow], params: dict[str, Any], first_key: int
                             ) -> list[list[Sample]]: ...

    async def generate_group(self, row: PromptRow, params: dict[str, Any], n: int | None = None, *,
                             group_key: int | None = None, scope: tuple[Any, ...] | None = None) -> list[Sample]: ...


async def collect_groups(manager: RoundSource, params: dict[str, Any], stats: dict[str, int]) -> list[list[Sample]]:
    """``rollout_batch_size`` kept groups for one step, in data order: one batched round when every group is
    kept; with a dynamic-sampling filter, rounds of groups generated as separate requests, rejected groups
    dropped, and what is still in flight aborted once enough are kept. ``stats`` counts kept, dropped, surplus,
    aborted groups and rounds."""
    target = manager.settings.rollout_batch_size
    round_size = (manager.settings.over_sampling_batch_size or 0) if manager.group_filter is not None else 0
    kept: list[tuple[tuple[int, int], list[Sample]]] = []
    for round_index in range(manager.max_sampling_rounds):
        need = target - len(kept)
        if need <= 0:
            break
        stats["rounds"] += 1
        position = manager.dataset.position  # the prompts' places in the run's prompt stream
        rows = manager.dataset.next_batch(max(need, round_size))
        first_key = manager.reserve_group_keys(len(rows))
        if manager.group_filter is None and not manager.generates_per_sample:  # every group is kept
            groups = await manager.generate_round(rows, params, first_key)
            for pos, group in enumerate(groups):
                for sample in group:
                    sample.prompt_key = position + pos
            kept.extend(((round_index, pos), group) for pos, group in enumerate(groups))
            continue
        running = {asyncio.create_task(manager.generate_group(row, params, group_key=first_key + pos)):
                 (round_index, pos) for pos, row in enumerate(rows)}
        pending: set[asyncio.Task[list[Sample]]] = set(running)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=running.__getitem__):
                    group = task.result()
                    for sample in group:
                        sample.prompt_key = position + running[task][1]
                    if len(kept) >= target:
                        stats["surplus"] += 1
                    elif manager.group_filter is None or manager.group_filter(group):
                        kept.append((running[task], group))
                    else:
                        stats["dropped"] += 1
                if len(kept) >= target and pending:
                    stats["aborted"] += len(pending)
                    break
        finally:
            if pending:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                await manager.pool.abort_all()
    if len(kept) < target:
        raise RaygymError(
            f"dynamic sampling kept {len(kept)} of rollout_batch_size={target} groups after "
            f"{manager.max_sampling_rounds} rounds ({stats['dropped']} dropped by dynamic_sampling_filter_path="
            f"{manager.settings.dynamic_sampling_filter_path!r}); raise over_sampling_batch_size or relax the filter"
        )
    kept.sort(key=lambda item: item[0])
    stats["kept"] = len(kept)
    return [group for _, group in kept]
