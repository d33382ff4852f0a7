"""The trainer-backend contract, the same suite for the torch and the Megatron backend (tiny Qwen3 dense
and MoE on CPU), driven through ``TrainerActor``: log-probs, a train step, KL against a reference model,
save -> load -> the next steps identical, export to HF; and both backends agreeing with each other.

Each backend runs once per session in its own process (``contract_worker.py``); the tests read its results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_setup import MEGATRON, MEGATRON_MISSING, save_tiny_model, spawn_ranks

from raygym.trainer.contract import ALWAYS_REPORTED

HERE = Path(__file__).resolve().parent
KINDS = ("dense", "moe")
BACKENDS = ["torch", MEGATRON]
# Loss metrics of a train step; both backends compute them with raygym.algo.rl_loss.
LOSS_METRICS = ("train/loss", "train/pg_loss", "train/entropy", "train/clipfrac", "train/approx_kl", "train/kl_loss")
TIS_METRICS = {"train/tis_weight", "train/tis_clipped_frac", "train/tis_masked_frac"}


@pytest.fixture(scope="session")
def contract_models(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("contract-models")
    return {kind: save_tiny_model(kind, directory) for kind in KINDS}


@pytest.fixture(scope="session")
def contract_results(tmp_path_factory, contract_models):
    """``results(backend) -> {kind: result dict}``, each backend's worker run once per session."""
    cache: dict[str, dict[str, dict]] = {}
    out = tmp_path_factory.mktemp("contract-runs")

    def results(backend: str) -> dict[str, dict]:
        if backend not in cache:
            models = [a for kind, path in contract_models.items() for a in ("--model", f"{kind}={path}")]
            spawn_ranks(str(HERE / "contract_worker.py"), ["--backend", backend, "--out", str(out), *models], world=1)
            cache[backend] = {kind: json.loads((out / f"{backend}_{kind}.json").read_text()) for kind in KINDS}
        return cache[backend]

    return results


def strip_perf(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_and_reference(contract_results, backend):
    for kind, res in contract_results(backend).items():
        assert res["facts"]["backend"] == backend and res["facts"]["reference_model"] is True, kind
        assert res["result_type"] == "LogProbResult" and res["result_keys"] == ["log_probs", "ref_log_probs"]
        assert res["lengths_ok"], kind
        assert res["logprob_vs_hf"] < 1e-4, (kind, res["logprob_vs_hf"])
        # the reference starts as the initial policy and stays there while the policy trains
        assert res["ref_equals_policy_at_start"] == 0.0, kind
        assert res["ref_moved"] == 0.0 and res["policy_moved"] > 1e-4, kind


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_step_metrics_and_kl(contract_results, backend):
    for kind, res in contract_results(backend).items():
        m0, m1 = res["metrics0"], res["next_a"][0]
        assert set(ALWAYS_REPORTED) | {"train/kl_loss"} <= set(m0), (kind, sorted(m0))
        assert not {"train/tis_weight", "train/dual_clipfrac"} & set(m0), kind  # features that are off
        assert m0["train/optimizer_steps"] == 2.0 and m0["train/grad_norm"] > 0, kind
        # policy == reference before the first update (ref_equals_policy_at_start); apart after it
        assert 0.0 < m0["train/kl_loss"] < 1.0 and m1["train/kl_loss"] > 0.0, kind
        total = m1["train/pg_loss"] + 0.1 * m1["train/kl_loss"] - 0.01 * m1["train/entropy"]
        assert m1["train/loss"] == pytest.approx(total, rel=1e-5, abs=1e-7), kind
        assert {"train/adv_mean", "train/adv_std", "train/adv_min", "train/adv_max"} <= set(m0), kind


@pytest.mark.parametrize("backend", BACKENDS)
def test_off_policy_correction_metrics(contract_results, backend):
    """use_tis with IcePop's token mask: the correction's metrics, some tokens masked and none truncated."""
    for kind, res in contract_results(backend).items():
        m = res["metrics_tis"]
        assert TIS_METRICS <= set(m), (kind, sorted(m))
        assert 0.0 < m["train/tis_masked_frac"] < 1.0 and m["train/tis_clipped_frac"] == 0.0, kind
        # kept weights lie in [0.8, 1.25], masked ones are 0: the mean is at most the kept share * 1.25
        assert 0.0 < m["train/tis_weight"] <= 1.25 * (1.0 - m["train/tis_masked_frac"]) + 1e-6, kind


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_then_next_steps_identical(contract_results, backend):
    for kind, res in contract_results(backend).items():
        assert res["loaded"] == {"rollout_id": 0, "start": 1, "extra": {"data_index": 8}}, kind
        assert res["loaded_equals_saved"] == 0.0 and res["loaded_ref_equals_ref"] == 0.0, kind
        assert [strip_perf(m) for m in res["next_b"]] == [strip_perf(m) for m in res["next_a"]], kind
        assert res["weights_identical"], kind
        assert res["checkpoint_has_optimizer"] and res["template_type"] == "CheckpointState", kind


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_to_hf(contract_results, backend):
    for kind, res in contract_results(backend).items():
        assert res["export_direct_vs_backend"] < 1e-4, (kind, res["export_direct_vs_backend"])
        assert res["export_ckpt_vs_saved"] < 1e-4, (kind, res["export_ckpt_vs_saved"])


@pytest.mark.megatron
@pytest.mark.skipif(MEGATRON_MISSING, reason="megatron-core is not installed (pip install 'raygym[megatron]')")
def test_backends_agree(contract_results):
    """Same model, batch and recipe: the same log-probs, metric names and (before any update) loss values."""
    torch_res, megatron_res = contract_results("torch"), contract_results("megatron")
    for kind in KINDS:
        t, m = torch_res[kind], megatron_res[kind]
        assert sorted(t["metrics0"]) == sorted(m["metrics0"]), kind
        worst = max(abs(a - b) for ra, rb in zip(t["log_probs"], m["log_probs"], strict=True)
                    for a, b in zip(ra, rb, strict=True))
        assert worst < 1e-4, (kind, worst)
        for key in LOSS_METRICS:
            assert m["metrics0"][key] == pytest.approx(t["metrics0"][key], rel=1e-3, abs=1e-5), (kind, key)
        assert m["metrics0"]["train/grad_norm"] == pytest.approx(t["metrics0"]["train/grad_norm"], rel=1e-3), kind
        assert sorted(t["metrics_tis"]) == sorted(m["metrics_tis"]), kind
        for key in (*LOSS_METRICS, *sorted(TIS_METRICS)):
            assert m["metrics_tis"][key] == pytest.approx(t["metrics_tis"][key], rel=1e-3, abs=1e-5), (kind, key)
        if kind == "dense":  # MoE: transformers 5 fuses the experts in memory, Megatron stores them as on disk
            assert m["checkpoint_tensor_names"] == t["checkpoint_tensor_names"]
