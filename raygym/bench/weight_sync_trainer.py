"""The trainer side ``raygym bench weight_sync`` and its serving section push from: rank 0 in this process, and the
order its syncs walk the trained versions in."""

from __future__ import annotations

import torch


class BenchTrainer:
    """Trainer rank 0 in this process, with TrainerActor's weight-sync methods; ``schedule`` maps each
    wire version to the trained weights it carries."""

    def __init__(self, versions: list[dict[str, torch.Tensor]]):
        from raygym.weightsync.sender import RankWeightSync

        self.versions = versions
        self.schedule: dict[int, int] = {}
        self.wsync = RankWeightSync(0)

    def init_weight_sync(self, spec):
        return self.wsync.init(spec)

    def push_weights(self, version: int, force_full: bool = False, refresh_snapshot: bool = True):
        return self.wsync.push(version, self.versions[self.schedule[version]].items(), force_full, refresh_snapshot)

    def commit_weights(self, version: int) -> None:
        self.wsync.commit(version)

    def discard_weights(self) -> None:
        self.wsync.discard()

    def reconnect_weight_sync(self):
        return self.wsync.reconnect()

    def close_weight_sync(self) -> None:
        self.wsync.close()


def ping_pong(steps: int, count: int) -> list[int]:
    """``count`` version indexes 1, 2, .., steps, steps-1, .., 1, 2, ..: every sync moves one trained step.

    >>> ping_pong(2, 5), ping_pong(3, 6)
    ([1, 2, 1, 2, 1], [1, 2, 3, 2, 1, 2])
    """
    if steps == 1:
        return [1, 0] * (count // 2) + [1] * (count % 2)
    cycle = list(range(1, steps + 1)) + list(range(steps - 1, 1, -1))
    return [cycle[i % len(cycle)] for i in range(count)]
