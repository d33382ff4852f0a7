"""`raygym plan`: resolved config + GPU allocation table, exit code 2 with the ConfigError on bad input.
The done-when checks run the real command in a subprocess; the rest call raygym.cli.main.main in process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from raygym.cli.main import allocation_rows, main
from raygym.config.allocation import compute_allocation


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raygym", *args], capture_output=True, text=True, timeout=120
    )


def test_plan_qwen3_4b_subprocess():
    done = run_cli("plan", "--preset", "qwen3-4b")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "1 node x 8 GPUs, colocated" in out
    assert "8 actor GPUs" in out and "8 engines" in out and "total nodes: 1" in out
    assert len(re.findall(r"engine \d", out)) == 8
    assert "Qwen/Qwen3-4B" in out


def test_plan_no_colocate_needs_two_nodes():
    done = run_cli("plan", "--preset", "qwen3-4b", "--no-colocate")
    assert done.returncode == 0, done.stderr
    assert "2 nodes x 8 GPUs, disaggregated" in done.stdout and "total nodes: 2" in done.stdout
    assert "node 1: GPU 7" in done.stdout  # the last engine is on the second node
    assert "rollout_num_gpus is unset" in done.stderr  # the resolver says it sized the rollout itself


def test_plan_sequence_parallel_fails_naming_tensor_parallel():
    done = run_cli("plan", "--preset", "qwen3-4b", "--sequence-parallel")
    assert done.returncode == 2
    assert "tensor_model_parallel_size" in done.stderr and done.stdout == ""


def test_plan_shows_changed_fields_and_critic(capsys):
    assert main(["plan", "--preset", "qwen3_4b", "--advantage-estimator", "ppo", "--use-critic"]) == 0
    out = capsys.readouterr().out
    assert "advantage_estimator = 'ppo'" in out and "use_critic = True" in out
    assert "critic" in out and "node 1: GPU 0-7" in out and "total nodes: 2" in out


def test_plan_default_is_tiny(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "builtin:tiny-qwen3" in out and "disaggregated" in out and "1 engines x 1 GPU" in out


def test_plan_with_toml(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('preset = "qwen3-14b"\n[recipe]\nnum_rollout = 3\n')
    assert main(["plan", "@", str(path), "--num-rollout", "4"]) == 0
    out = capsys.readouterr().out
    assert "num_rollout = 4" in out and "4 engines x 2 GPU" in out


@pytest.mark.parametrize(
    "args, fragment",
    [(["--rollout-batch-size", "0"], "rollout_batch_size=0"), (["--lr", "x"], "lr='x'"),
     (["--bogus"], "unrecognized arguments: --bogus"), (["--preset", "nope"], "preset='nope'"),
     (["@", "/nonexistent/run.toml"], "does not exist")],
)  # fmt: skip
def test_bad_input_exits_2_with_message(args, fragment, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raygym: error:") and fragment in err


def test_help_lists_generated_flags(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--cluster",
        "--n-samples-per-prompt",
        "--hf-checkpoint",
        "--prompt-data",
        "--wandb-project",
        "--run-id",
    ):
        assert flag in out
    assert main(["train", "-h"]) == 0
    assert "--rollout-batch-size" in capsys.readouterr().out


def test_train_rejects_bad_config_before_anything_starts(capsys):
    assert main(["train", "--sequence-parallel", "--preset", "qwen3-4b"]) == 2
    assert "tensor_model_parallel_size" in capsys.readouterr().err


def test_python_dash_m_raygym_train_is_raygym_train():
    done = subprocess.run([sys.executable, "-m", "raygym.train", "--num-rollout", "0"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "num_rollout=0" in done.stderr


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["trian"]) == 2


def test_allocation_rows_keep_engines_inside_nodes():
    alloc = compute_allocation(actor_num_nodes=2, actor_num_gpus_per_node=4, colocate=False, rollout_num_gpus=8,
                               rollout_num_gpus_per_engine=2)  # fmt: skip
    rows = allocation_rows(alloc)
    assert rows[0] == ("actor", "node 0: GPU 0-3; node 1: GPU 0-3", "8 GPUs")
    engines = [r for r in rows if r[0].startswith("engine")]
    assert [r[1] for r in engines] == [
        "node 2: GPU 0-1",
        "node 2: GPU 2-3",
        "node 3: GPU 0-1",
        "node 3: GPU 2-3",
    ]
