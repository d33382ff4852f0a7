"""How CPU cores are split between trainer ranks and the engines that decode beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from raygym import ModelConfig, Recipe, TrainConfig
from raygym.presets import tiny
from raygym.trainer.backend import TrainerSettings
from raygym.trainer.decisions import cpu_training_threads


def test_trainer_threads_share_the_node_and_leave_busy_cores():
    assert cpu_training_threads(2, 1) == 2
    assert cpu_training_threads(16, 4) == 4
    assert cpu_training_threads(2, 4) == 1  # never 0
    assert cpu_training_threads(2, 1, busy_cores=1) == 1
    assert cpu_training_threads(16, 2, busy_cores=4) == 6
    assert cpu_training_threads(2, 1, busy_cores=8) == 1


def test_only_async_engines_overlap_training():
    def engine_threads(**fields):
        recipe = Recipe(**{**tiny().model_dump(), "actor_num_gpus_per_node": 2, **fields})
        return TrainerSettings.from_config(TrainConfig(recipe=recipe, model=ModelConfig(hf_checkpoint="m"))).engine_threads

    assert engine_threads(colocate=True) == 0  # colocated: the engines are released while the trainer trains
    assert engine_threads(rollout_num_gpus=2) == 0  # sync: engines idle while training
    assert engine_threads(rollout_num_gpus=2, async_mode=True) == 2
    assert engine_threads(rollout_num_gpus=2, fully_async=True) == 2  # generation never stops
    assert engine_threads(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, async_mode=True) == 2


# --- one compute thread per process (raygym/cluster/cpu_threads.py) -------------------------------------------
# Each check runs in a fresh interpreter: it changes the process's torch thread settings.

_CHILD_PRELUDE = """
import json, os, sys, threading
import torch
from raygym.cluster.cpu_threads import claim_torch_threads, dedicate_torch_threads, make_serial_default

def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]

def os_threads():
    return len(os.listdir("/proc/self/task"))
"""


def _run_child(body: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # OpenMP's own default: every core
    done = subprocess.run([sys.executable, "-c", _CHILD_PRELUDE + textwrap.dedent(body)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_dedicated_thread_keeps_its_threads_and_every_later_thread_runs_serially():
    out = _run_child("""
        got = dedicate_torch_threads(2)
        helper = in_thread(torch.get_num_threads)
        claimed = in_thread(lambda: claim_torch_threads(3))
        print(json.dumps({"got": got, "main": torch.get_num_threads(), "helper": helper, "claimed": claimed,
                          "main_after": torch.get_num_threads()}))
    """)
    assert out == {"got": 2, "main": 2, "helper": 1, "claimed": 3, "main_after": 2}


def test_a_helper_threads_parallel_work_opens_no_openmp_team():
    """What the rule is for: libgomp keeps a team of threads for every thread that opens a parallel region, and
    once a process holds more OpenMP threads than cores its teams sleep between regions (each decode step then
    pays hundreds of wake-ups). A serial helper runs a large parallel-eligible op on itself alone."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here: an OpenMP team is a single thread either way, nothing to tell apart")
    out = _run_child("""
        big = torch.randn(4_000_000)
        def work():
            before = os_threads()
            big.clone().mul_(2).sum()
            return os_threads() - before
        without_rule = in_thread(work)   # the default (all cores): the helper's team adds OpenMP threads
        dedicate_torch_threads(2)
        torch.randn(4_000_000).sum()     # the dedicated thread's own team
        with_rule = in_thread(work)
        print(json.dumps({"without_rule": without_rule, "with_rule": with_rule}))
    """)
    assert out["without_rule"] >= 1  # the check can tell: without the rule the helper grows a team
    assert out["with_rule"] == 0


def test_raygym_servers_generation_thread_claims_the_cores_and_its_helpers_stay_serial():
    out = _run_child("""
        from raygym.builtin import build_tiny_model
        from raygym.engines.raygym_server.generation import GenerationEngine
        from raygym.engines.raygym_server.generation_request import GenerationRequest
        from raygym.engines.raygym_server.sampling import SamplingParams

        model, _ = build_tiny_model(0)
        make_serial_default()
        engine = GenerationEngine(model, compute_threads=2)
        engine.start()
        seen = []
        request = GenerationRequest(rid="r", input_ids=[3, 4], params=SamplingParams.from_dict({"max_new_tokens": 2}),
                                    on_done=lambda r: seen.append(torch.get_num_threads()))
        engine.submit(request)
        assert request.wait(60)
        engine.stop()
        print(json.dumps({"generation": seen[0], "main": torch.get_num_threads(),
                          "helper": in_thread(torch.get_num_threads)}))
    """)
    assert out == {"generation": 2, "main": 1, "helper": 1}


def test_async_trainer_and_engine_take_disjoint_cores_and_shared_leaves_them_free():
    """``cpu_placement="disjoint"``: while engines decode beside it, a trainer rank is pinned to its slice and
    the servers to the last cores (the same split on both sides); sync runs and ``"shared"`` pin nothing."""
    from raygym.engines.launch.sglang import engine_cpu_cores

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here: there is no second core to split off")
    cores = sorted(os.sched_getaffinity(0))
    one_step_off = tiny().replace(async_mode=True)
    assert engine_cpu_cores(one_step_off, cores) == (cores[-1],)
    assert engine_cpu_cores(tiny(), cores) is None
    assert engine_cpu_cores(one_step_off.replace(cpu_placement="shared"), cores) is None
    out = _run_child("""
        from raygym import ModelConfig, TrainConfig
        from raygym.presets import tiny
        from raygym.trainer.backend import TrainerSettings
        from raygym.trainer.decisions import set_cpu_training_cores

        def settings(**fields):
            cfg = TrainConfig(recipe=tiny().replace(**fields), model=ModelConfig(hf_checkpoint="m"))
            return TrainerSettings.from_config(cfg)

        all_cores = sorted(os.sched_getaffinity(0))
        sync_threads = set_cpu_training_cores(settings(), 0, 1)
        after_sync = sorted(os.sched_getaffinity(0))
        threads = set_cpu_training_cores(settings(async_mode=True), 0, 1)
        helper_cores = in_thread(lambda: sorted(os.sched_getaffinity(0)))
        print(json.dumps({"all": all_cores, "sync_threads": sync_threads, "after_sync": after_sync,
                          "threads": threads, "pinned": sorted(os.sched_getaffinity(0)), "helper": helper_cores}))
    """)
    assert out["after_sync"] == out["all"] and out["sync_threads"] == len(out["all"])  # sync: every core, unpinned
    assert out["pinned"] == out["helper"] == out["all"][:-1]  # every thread of the rank, the engines' core left out
    assert out["threads"] == len(out["all"]) - 1
