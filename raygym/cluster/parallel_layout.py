"""Which trainer ranks form which Megatron groups, worked out on paper (pure; no Megatron, no Ray): what
``raygym plan`` prints for a Megatron recipe, so a MoE layout (tensor, expert and data parallel) can be checked
before a GPU is taken.

Megatron numbers ranks with tensor parallelism fastest, then context, expert (for expert layers), data and
pipeline parallelism (its default order ``tp-cp-ep-dp-pp``). Dense layers split over ``tp`` ranks and replicate
over the data-parallel ones; expert layers keep whole experts on each rank (expert tensor parallel 1, as
``raygym.trainer.megatron_model.init_parallel_state`` sets it) and split the experts over ``ep`` consecutive
ranks, replicating each over the expert-data-parallel ones.

>>> layout = ParallelLayout(world=8, tp=4, ep=8, num_experts=128)
>>> layout.groups("tp"), layout.groups("dp")
([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
>>> layout.groups("ep"), layout.experts_of(3)
([[0, 1, 2, 3, 4, 5, 6, 7]], range(48, 64))
"""

from __future__ import annotations

from dataclasses import dataclass

from raygym.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """The groups of a Megatron trainer of ``world`` ranks (``num_experts`` 0 for a dense model)."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    num_experts: int = 0

    def __post_init__(self) -> None:
        if self.world % (self.tp * self.cp * self.pp) or self.world % (self.ep * self.pp):
            raise ConfigError(f"a trainer of {self.world} ranks does not split into tensor {self.tp} x context "
                              f"{self.cp} x pipeline {self.pp}, or into expert {self.ep} x pipeline {self.pp}")
        if self.num_experts and self.num_experts % self.ep:
            raise ConfigError(f"num_experts={self.num_experts} is not divisible by expert_model_parallel_size="
                              f"{self.ep}; choose an expert-parallel size that divides it")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.pp)

    def groups(self, kind: str) -> list[list[int]]:
        """The rank groups of ``kind``: ``tp``, ``dp`` (dense layers) or ``ep``, ``expert_dp`` (expert layers)."""
        if kind == "tp":
            return [list(range(s, s + self.tp)) for s in range(0, self.world, self.tp)]
        if kind == "dp":  # stride tp * cp inside each pipeline stage
            stride, stage = self.tp * self.cp, self.world // self.pp
            return [list(range(p * stage + off, (p + 1) * stage, stride)) for p in range(self.pp) for off in range(stride)]
        if kind == "ep":
            return [list(range(s, s + self.ep)) for s in range(0, self.world, self.ep)]
        if kind == "expert_dp":
            stage = self.world // self.pp
            return [list(range(p * stage + off, (p + 1) * stage, self.ep)) for p in range(self.pp) for off in range(self.ep)]
        raise ValueError(f"kind={kind!r}: use tp, dp, ep or expert_dp")

    def experts_of(self, rank: int) -> range:
        """The global experts rank ``rank`` holds."""
        per = self.num_experts // self.ep
        first = (rank % self.ep) * per
        return range(first, first + per)

    def lines(self) -> list[str]:
        """What ``raygym plan`` prints."""
        out = [f"trainer layout (megatron): {self.world} ranks = tensor {self.tp} x context {self.cp} x data "
               f"{self.dp} x pipeline {self.pp}",
               f"  tensor-parallel groups: {_ranges(self.groups('tp'))}",
               f"  data-parallel groups:   {_ranges(self.groups('dp'))}"]
        if self.num_experts:
            per = self.num_experts // self.ep
            out += [f"  experts: {self.num_experts} over expert {self.ep} x expert-data {self.expert_dp} (whole experts "
                    f"per rank, expert tensor parallel 1): {per} per rank",
                    f"  expert-parallel groups: {_ranges(self.groups('ep'))}; rank r holds experts "
                    f"{per}*(r mod {self.ep}) .. {per}*(r mod {self.ep})+{per - 1}"]
            if self.expert_dp > 1:
                out.append(f"  expert-data-parallel groups: {_ranges(self.groups('expert_dp'))}")
        return out


def _ranges(groups: list[list[int]]) -> str:
    def one(g: list[int]) -> str:
        return f"[{g[0]}-{g[-1]}]" if len(g) > 2 and g == list(range(g[0], g[-1] + 1)) else str(g).replace(" ", "")

    return " ".join(one(g) for g in groups)
