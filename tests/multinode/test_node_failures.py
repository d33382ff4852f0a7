"""Disaggregated training across separate Ray nodes, and nodes dying under it.

The cluster (``conftest.py``): a CPU head and workers w1, w2, w3 of one logical GPU each, every node in its
own network namespace with its own address; runs are submitted from this process to the head's dashboard
(``raygym.launchers.ray_job``), as from a laptop. The tiny recipe with two engines needs three GPU nodes: placement
sorts them by address, so the trainer lands on w1 and the engines on w2 and w3; weights cross the namespace
boundary over gloo. A node dies as a machine does: every process in its namespace is SIGKILLed.

- an engine node dies mid-rollout and comes back: its requests are retried on the other engine, the run goes
  on with one engine, then a new engine is started on the returned node, synced, verified and given
  requests again; every step keeps all its samples;
- the trainer node dies: the job fails naming the trainer and the last complete checkpoint; the launcher
  (``--resubmit 1``) submits it again with ``--load``, the new job waits for a node to take the trainer's GPU,
  and once the node returns the run resumes there: every step and every prompt position exactly once.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raygym.cluster.shape import cluster_shape, roles_by_node
from raygym.launchers.ray_job import REPO_ROOT, JobOutcome, resolve_recipe, submit_train_job
from scripts.local_cluster import LocalCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BATCH = 8  # prompts per step
RUN = ["--preset", "tiny", "--rollout-num-gpus", "2", "--rollout-batch-size", str(BATCH),
       "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--rollout-max-response-len", "64",
       "--seed", "3"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file a run is writing ([] before it exists)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Job:
    """A submitted run, followed through its files and its status."""

    def __init__(self, cluster: LocalCluster, out: Path, args: list[str]) -> None:
        from ray.job_submission import JobSubmissionClient

        self.out = out
        outcome = submit_train_job(cluster.dashboard_url, [*args, "--output-dir", str(out)], environ=cluster.env,
                                   working_dir=str(REPO_ROOT), follow=False, out=print)
        self.id = outcome.job_id
        self.client = JobSubmissionClient(cluster.dashboard_url)

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "metrics.jsonl")

    def status(self) -> str:
        return str(self.client.get_job_status(self.id).value)

    def logs(self) -> str:
        return str(self.client.get_job_logs(self.id))

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float = 400.0) -> None:
        """Poll ``ready`` (the run's files) until true; fails at once if the job ends first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            status = self.status()
            assert status not in TERMINAL, f"job {status} before {what}:\n{self.logs()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s:\n{self.logs()[-4000:]}"
            time.sleep(0.05)

    def wait_end(self, timeout_s: float = 400.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (status := self.status()) not in TERMINAL:
            assert time.monotonic() < deadline, f"job still {status} after {timeout_s:.0f} s:\n{self.logs()[-4000:]}"
            time.sleep(0.5)
        return status


def squeezed(text: str) -> str:
    """``text`` without any whitespace (compares console output however it was wrapped)."""
    return "".join(text.split())


def assert_every_position_once(out: Path, steps: int) -> list[dict[str, Any]]:
    """prompts.jsonl names each step once, and the steps together take stream positions 0, 1, 2, ... once."""
    prompts = read_jsonl(out / "prompts.jsonl")
    assert [p["step"] for p in prompts] == list(range(steps))
    assert [k for p in prompts for k in p["prompt_key"]] == list(range(steps * BATCH))
    indexes = [i for p in prompts for i in p["data_index"]]
    assert len(set(indexes)) == len(indexes)  # one epoch: no prompt twice
    return prompts


def wait_released(cluster: LocalCluster) -> None:
    """The run's actors end with its job (their placement group is removed)."""
    deadline = time.monotonic() + 60
    while any(name in ("TrainerActor", "EngineActor", "RolloutManager") for name, _ in cluster.actors()):
        assert time.monotonic() < deadline, cluster.actors()
        time.sleep(0.5)


def test_plan_shows_the_cluster_layout_from_outside_it(nodes_up: LocalCluster) -> None:
    """``raygym plan --cluster <dashboard>`` run here, on no Ray node, lays the run out on the real nodes."""
    plan = subprocess.run([sys.executable, "-m", "raygym.cli.main", "plan", *RUN, "--cluster", nodes_up.dashboard_url],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert plan.returncode == 0, plan.stderr[-3000:]
    rows = re.findall(r"(\d+\.\d+\.\d+\.\d+)\W+\d+\W+(actor|critic|rollout)", plan.stdout)
    w = nodes_up.nodes
    assert rows == [(w["w1"].ip, "actor"), (w["w2"].ip, "rollout"), (w["w3"].ip, "rollout")], plan.stdout


def test_engine_node_dies_mid_rollout_and_returns(nodes_up: LocalCluster, tmp_path: Path) -> None:
    cluster, steps = nodes_up, 24
    job = Job(cluster, tmp_path / "run", [*RUN, "--num-rollout", str(steps), "--save-interval", "100"])
    job.wait_until(lambda: len(job.rows()) >= 2, "the first two steps")

    # Where everything runs: as the pure layout predicts for this cluster's addresses, one role per node.
    ips = [n.ip for n in cluster.nodes.values()]
    recipe = resolve_recipe(RUN)
    predicted = roles_by_node(recipe, ips, cluster_shape(recipe))
    assert predicted == {ips[0]: [], ips[1]: ["actor 0"], ips[2]: ["engine 0"], ips[3]: ["engine 1"]}
    placed = cluster.actors()
    assert ("TrainerActor", cluster.nodes["w1"].ip) in placed
    assert {ip for name, ip in placed if name == "EngineActor"} == {cluster.nodes["w2"].ip, cluster.nodes["w3"].ip}
    assert ("RolloutManager", cluster.head.ip) in placed  # beside the driver: no GPU node's death takes it

    # The row of step 1 is written once step 2's rollout is in flight: w2 dies under it, then comes back.
    assert len(job.rows()) == 2
    killed = cluster.kill_node("w2")
    assert killed
    cluster.wait_dead("w2")
    cluster.start_node("w2")
    assert job.wait_end() == "SUCCEEDED", job.logs()[-4000:]

    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["rollout/samples"] == 64 for r in rows)  # nothing lost: every step trained on its whole batch
    assert sum(r["rollout/engine_failures"] for r in rows) >= 1
    assert sum(r["rollout/request_retries"] for r in rows) >= 1  # requests in flight went to engine 1
    assert rows[2]["rollout/engine1_requests"] >= 32  # engine 1 served at least its share of the step
    one_engine = [r["step"] for r in rows if r["sync/engines"] == 1]
    assert one_engine, "the run never went on with the remaining engine"
    back = [r["step"] for r in rows if r["sync/engines"] == 2 and r["step"] > one_engine[0]]
    assert back, f"the engine never came back (steps on one engine: {one_engine})"
    last = rows[-1]
    assert last["sync/engines_replaced"] == 1 and last["sync/engines"] == 2
    # back in rotation only after a verified sync: every checksum matched on both engines, no resync needed
    assert all(r["sync/full_resyncs"] == 0 for r in rows)
    assert last["rollout/engine0_requests"] > 0 and last["rollout/engine1_requests"] > 0
    assert "engine 0: replaced" in job.logs()
    assert_every_position_once(job.out, steps)
    wait_released(cluster)


def test_a_partitioned_engine_node_has_its_requests_moved_at_the_health_check(nodes_up: LocalCluster,
                                                                               tmp_path: Path) -> None:
    """The engine node's link is cut mid-rollout: nothing resets the connections, so its requests in flight
    would wait for their timeout (600 s). The health check (2 s here) marks the engine failed and the requests
    move to the other engine at once; the run goes on with one engine, and with two once the node is back."""
    cluster, steps = nodes_up, 12
    # full-length responses, near the tiny model's 256 positions: a rollout (~0.6 s) long enough that the cut,
    # a few tens of ms after it starts, lands while requests are in flight
    run = [*RUN, "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "2",
           "--sglang-request-params", '{"ignore_eos": true}', "--rollout-max-response-len", "224"]
    job = Job(cluster, tmp_path / "run", [*run, "--num-rollout", str(steps), "--save-interval", "100"])
    job.wait_until(lambda: len(job.rows()) >= 2, "the first two steps")
    link = cluster.nodes["w2"].host_if  # engine 0's node, as the layout test above finds
    subprocess.run(["ip", "link", "set", link, "down"], check=True)  # step 2's rollout is in flight
    try:
        # the link stays cut until step 2 is done: its requests on engine 0 can end only by leaving it (a link
        # back too soon lets them finish there, late; the health check takes its interval plus its timeouts)
        job.wait_until(lambda: len(job.rows()) >= 3, "step 2 with engine 0 cut off", timeout_s=120)
        cluster.wait_dead("w2")
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    cluster.kill_node("w2")  # the raylet Ray declared dead stops anyway; the node comes back fresh
    cluster.start_node("w2")
    assert job.wait_end() == "SUCCEEDED", job.logs()[-4000:]

    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["rollout/samples"] == 64 for r in rows)
    # Taken off the cut-off engine, not timed out (the job ended well inside the 600 s request timeout): moved
    # when the health check marked the engine, or retried when the kernel gave up resolving its address first
    # (a stale ARP entry: "no route to host" after ~3 s), whichever came first.
    cut = rows[2]
    if cut["rollout/engine0_requests"] > 0:  # requests were on engine 0 when its link went: they left it
        assert cut["rollout/requests_moved"] + cut["rollout/request_retries"] >= 1, cut
    assert cut["rollout/engine1_requests"] > BATCH * 8 // 2  # engine 1 took over engine 0's share of the step
    assert sum(r["rollout/engine_failures"] + r["rollout/requests_moved"] for r in rows) >= 1  # it was noticed
    assert all(r["rollout/malformed_answers"] == 0 for r in rows)
    assert_every_position_once(job.out, steps)
    wait_released(cluster)


def test_trainer_node_dies_and_the_resubmitted_run_resumes(nodes_up: LocalCluster, tmp_path: Path) -> None:
    cluster, steps, out = nodes_up, 8, tmp_path / "run"
    args = [*RUN, "--num-rollout", str(steps), "--save-interval", "2",  # checkpoints after steps 1, 3, 5, 7
            "--output-dir", str(out)]
    said: list[str] = []  # what the launcher prints: the job ids, then the jobs' logs as they stream
    outcome: list[JobOutcome] = []
    launcher = threading.Thread(target=lambda: outcome.append(submit_train_job(
        cluster.dashboard_url, args, environ=cluster.env, working_dir=str(REPO_ROOT), resubmits=1,
        out=said.append)), daemon=True)  # what `python -m raygym.launchers.ray_job --resubmit 1 ...` does
    launcher.start()

    def wait_for(ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 400
        while not ready():
            assert launcher.is_alive(), f"the launcher ended before {what}:\n" + "\n".join(said[-60:])
            assert time.monotonic() < deadline, f"no {what}:\n" + "\n".join(said[-60:])
            time.sleep(0.05)

    wait_for(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 5, "five steps")
    cluster.kill_node("w1")  # the trainer's node, while step 5's rollout runs
    wait_for(lambda: any("failed; resubmitting" in line for line in said), "resubmission")
    checkpoint = out / "checkpoints" / "iter_0000003"
    printed = "\n".join(said)
    assert "trainer rank 0 died" in printed and f"the last complete checkpoint is {checkpoint}" in printed
    # The resubmitted job waits for a node with a GPU to take the trainer's bundle: nothing is written yet.
    before = {p["step"]: p for p in read_jsonl(out / "prompts.jsonl")}
    assert sorted(before) == [0, 1, 2, 3, 4]

    cluster.start_node("w1")
    launcher.join(timeout=400)
    assert outcome and outcome[0].status == "SUCCEEDED", "\n".join(said[-60:])
    resumed = f"resumed from {checkpoint} (saved after step 3); continuing at step 4"
    assert squeezed(resumed) in squeezed("\n".join(said))  # the console wraps long lines
    assert len([line for line in said if line.startswith("job id: ")]) == 2

    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(steps))  # 0 lost, 0 repeated
    prompts = {p["step"]: p for p in assert_every_position_once(out, steps)}
    # Steps the checkpoint covered are kept as they were; step 4, lost with the trainer, ran again on the
    # same prompts (the checkpoint's data position), so the run saw exactly what an uninterrupted one would.
    assert all(prompts[s] == before[s] for s in range(5))
    wait_released(cluster)
