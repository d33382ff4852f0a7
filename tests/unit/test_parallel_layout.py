"""``raygym plan`` on the Qwen3-30B-A3B recipe (2 nodes x 8 GPUs, no GPU needed) shows the trainer's tensor, data
and expert groups; the groups on paper are megatron-core's own (its RankGenerator, where megatron-core is
installed) for dense and MoE layouts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from raygym.cluster.parallel_layout import ParallelLayout
from raygym.errors import ConfigError


def test_plan_of_the_30b_a3b_recipe_shows_its_expert_and_tensor_layout():
    done = subprocess.run([sys.executable, "-m", "raygym", "plan", "--preset", "qwen3-30b-a3b"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "2 nodes x 8 GPUs, disaggregated" in out and "2 engines x 4 GPU" in out
    assert "8 ranks = tensor 4 x context 1 x data 2 x pipeline 1" in out
    assert "tensor-parallel groups: [0-3] [4-7]" in out and "data-parallel groups:   [0,4] [1,5] [2,6] [3,7]" in out
    assert "experts: 128 over expert 8 x expert-data 1" in out and "16 per rank" in out
    assert "expert-parallel groups: [0-7]" in out


def test_experts_that_do_not_split_over_the_expert_ranks_are_refused():
    with pytest.raises(ConfigError, match="num_experts=60 is not divisible by expert_model_parallel_size=8"):
        ParallelLayout(world=8, ep=8, num_experts=60)


# run in CI's Megatron phase; megatron.core, not megatron: tests/megatron, on pytest's path, is a namespace package
@pytest.mark.megatron
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
                    reason="megatron-core is not installed")
@pytest.mark.parametrize("world,tp,pp,cp,ep", [(8, 4, 1, 1, 8), (16, 2, 2, 1, 4), (8, 2, 1, 2, 2), (2, 1, 1, 1, 2),
                                               (8, 8, 1, 1, 1)])
def test_groups_are_megatrons(world, tp, pp, cp, ep):
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(world=world, tp=tp, pp=pp, cp=cp, ep=ep, num_experts=8 * ep)
    dense = RankGenerator(tp=tp, ep=1, dp=layout.dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=1, ep=ep, dp=layout.expert_dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert layout.groups("tp") == dense.get_ranks("tp") and layout.groups("dp") == dense.get_ranks("dp")
    assert layout.groups("ep") == expert.get_ranks("ep") and layout.groups("expert_dp") == expert.get_ranks("dp")
