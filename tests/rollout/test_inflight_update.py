"""A weight update that lands while requests are generating (fully asynchronous training on raygym's server):
the requests go on with the new weights, every token is stamped with the version that produced it, and each
part's log-probs are exactly those of its own weights (the running batch's KV cache is recomputed on the new
weights, as SGLang's retract does) — checked against full forward passes of the two models."""

from __future__ import annotations

import torch

from raygym.builtin import build_tiny_model
from raygym.engines.raygym_server.generation import GenerationEngine, GenerationRequest
from raygym.engines.raygym_server.sampling import SamplingParams
from tests.rollout.test_generation import reference_logprobs


def test_tokens_after_an_inflight_update_carry_the_new_version_and_its_logprobs():
    old, tok = build_tiny_model(0)
    new, _ = build_tiny_model(1)
    served = build_tiny_model(0)[0].eval()  # the engine's copy, updated in place
    label = {"v": "0"}
    engine = GenerationEngine(served, eos_token_ids=[tok.eos_token_id], tokenizer=tok, max_running_requests=8)
    engine.weight_label = lambda: label["v"]
    engine.start()
    try:
        prompts = [tok.encode(p) for p in ("next:1=", "copy:abc=", "7+8=")]
        params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
        reqs = [GenerationRequest(str(i), p, params) for i, p in enumerate(prompts)]
        short = GenerationRequest("short", prompts[0], SamplingParams(temperature=1.0, max_new_tokens=5,
                                                                         ignore_eos=True))
        engine.pause("in_place")  # everything queues, then starts as one batch
        engine.submit_all([*reqs, short])
        engine.resume()
        assert short.wait(60)  # five decode steps of the batch are done
        parks = engine.stats.parks
        engine.pause("in_place")  # halt the running batch between two decode steps
        assert engine.wait_parked(after=parks)
        with engine.exclusive(wait_idle=False):  # what /raygym/shadow_switch holds: the model, between steps
            served.load_state_dict(new.state_dict())
            label["v"] = "1"
        engine.resume()
        for r in reqs:
            assert r.wait(60)
    finally:
        engine.stop()
    assert engine.stats.recomputed >= 1
    for p, r in zip(prompts, reqs, strict=True):
        assert len(r.output_ids) == 40 and len(r.output_versions) == 40
        split = r.output_versions.index("1")
        assert 0 < split < 40 and set(r.output_versions[:split]) == {"0"} and set(r.output_versions[split:]) == {"1"}
        got = torch.tensor(r.output_logprobs)
        want_old = reference_logprobs(old.eval(), p, r.output_ids, 1.0)
        want_new = reference_logprobs(new.eval(), p, r.output_ids, 1.0)
        torch.testing.assert_close(got[:split], want_old[:split], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[split:], want_new[split:], atol=1e-4, rtol=1e-4)
