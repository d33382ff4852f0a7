"""HF -> Megatron -> HF round trip, log-prob parity with HF, and a train step, on CPU (gloo).

Each case runs in fresh processes (tp_worker.py) because Megatron's parallel state is process-global.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import megatron_skip_reason, run_ranks

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(megatron_skip_reason() is not None, reason=str(megatron_skip_reason())),
]


def _save_tiny(kind: str, directory) -> str:
    from raygym.builtin import build_tiny_model, build_tokenizer

    if kind == "dense":
        model, tok = build_tiny_model(seed=3)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        tok = build_tokenizer()
        config = Qwen3MoeConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        torch.manual_seed(4)
        model = Qwen3MoeForCausalLM(config)
        # Random init of router / norms is near-constant; spread them so routing and norms matter.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight") or "norm" in name:
                    p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    path = directory / kind
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _results(prefix, world: int) -> list[dict]:
    return [json.loads((prefix.parent / f"{prefix.name}.rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_bit_exact_log_probs_match_hf_and_train_step(tmp_path, tp):
    """Dense and MoE Qwen3 at TP=tp (gloo, tp processes); at TP=1 the dense model also trains one step."""
    models = {kind: _save_tiny(kind, tmp_path) for kind in ("dense", "moe")}
    prefix = tmp_path / f"tp{tp}"
    args = ["--out", str(prefix), "--tp", str(tp)] + [a for k, d in models.items() for a in ("--model", f"{k}={d}")]
    run_ranks(args + (["--train"] if tp == 1 else []), world=tp)
    for rank_results in _results(prefix, tp):
        for kind, res in rank_results.items():
            assert res["facts"]["tp_size"] == tp, kind
            assert res["missing"] == [] and res["extra"] == [], kind
            assert res["mismatched"] == [], f"{kind}: exported tensors differ in bytes from the checkpoint"
            assert res["n_tensors"] > (30 if kind == "moe" else 20), kind
            assert res["lengths_ok"], kind
            assert res["logprob_max_abs_diff"] < 1e-5, (kind, res["logprob_max_abs_diff"])
    if tp == 1:
        res = _results(prefix, 1)[0]["dense"]
        metrics = res["train_metrics"]
        assert all(v == v and abs(v) < 1e6 for v in metrics.values()), metrics  # finite
        assert metrics["train/grad_norm"] > 0 and metrics["train/lr"] == 1e-3
        assert res["changed_tensors"] > 20
        assert res["objective_after"] > res["objective_before"]
