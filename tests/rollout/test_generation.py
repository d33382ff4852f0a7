"""GenerationEngine (pure torch, no HTTP) against the model's own forward pass and HF generate."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from raygym.builtin import build_tiny_model
from raygym.engines.raygym_server.generation import EngineUnavailable, GenerationEngine, GenerationRequest
from raygym.engines.raygym_server.sampling import SamplingParams, sample_next_tokens


@pytest.fixture(scope="module")
def model_and_tok():
    model, tok = build_tiny_model(0)
    return model.eval(), tok


@pytest.fixture()
def engine(model_and_tok):
    model, tok = model_and_tok
    eng = GenerationEngine(
        model, eos_token_ids=[tok.eos_token_id], tokenizer=tok, max_running_requests=16, seed=3
    )
    eng.start()
    yield eng
    eng.stop()


def run_all(engine: GenerationEngine, requests: list[GenerationRequest], timeout: float = 60) -> None:
    for r in requests:
        engine.submit(r)
    for r in requests:
        assert r.wait(timeout), f"request {r.rid} did not finish"


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the model at each generated token, from one full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def prompts(tok) -> list[list[int]]:
    return [tok.encode(s) for s in ("next:1=", "next:23=", "a", "hello world 42=", "7+8=")]


def test_greedy_batch_with_left_padding_matches_hf_generate(engine, model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok)
    reqs = [
        GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
        for i, p in enumerate(ps)
    ]
    run_all(engine, reqs)
    assert engine.stats.max_batch_size == len(ps)  # submitted together -> one batch
    for p, r in zip(ps, reqs, strict=True):
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert r.output_ids == ref
        assert r.finish_reason == {"type": "length", "length": 10}
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs),
            reference_logprobs(model, p, r.output_ids, 0.0),
            atol=1e-4,
            rtol=1e-4,
        )


def test_sampled_logprobs_are_temperature_scaled_and_unfiltered(engine, model_and_tok):
    model, tok = model_and_tok
    ps = prompts(tok)
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=12, ignore_eos=True)
    reqs = [GenerationRequest(str(i), p, params) for i, p in enumerate(ps)]
    run_all(engine, reqs)
    for p, r in zip(ps, reqs, strict=True):
        torch.testing.assert_close(
            torch.tensor(r.output_logprobs),
            reference_logprobs(model, p, r.output_ids, 0.7),
            atol=1e-4,
            rtol=1e-4,
        )


def test_rows_with_different_lengths_leave_the_batch_without_changing_results(engine, model_and_tok):
    _, tok = model_and_tok
    ps = prompts(tok)
    lengths = [1, 7, 3, 12, 5]
    together = [
        GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(ps, lengths, strict=True))
    ]
    run_all(engine, together)
    for p, n, r in zip(ps, lengths, together, strict=True):
        alone = GenerationRequest(
            "alone", p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        )
        run_all(engine, [alone])
        assert len(r.output_ids) == n
        assert r.output_ids == alone.output_ids[:n]


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine, model_and_tok):
    _, tok = model_and_tok
    p = tok.encode("next:5=")

    def sample(seed: int) -> list[int]:
        r = GenerationRequest(
            "s", p, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=seed)
        )
        run_all(engine, [r])
        return r.output_ids

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_stop_token_ids_and_eos(engine, model_and_tok):
    _, tok = model_and_tok
    p = tok.encode("next:9=")
    free = GenerationRequest("f", p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    run_all(engine, [free])
    stop_id = free.output_ids[3]
    first = free.output_ids.index(stop_id)
    stopped = GenerationRequest(
        "s", p, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
    )
    eos_engine_req = GenerationRequest("e", p, SamplingParams(temperature=0.0, max_new_tokens=12))
    run_all(engine, [stopped, eos_engine_req])
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_id}
    # Without ignore_eos the row stops at the eos token if greedy decoding produces one.
    if tok.eos_token_id in free.output_ids:
        assert eos_engine_req.finish_reason["matched"] == tok.eos_token_id
    else:
        assert eos_engine_req.output_ids == free.output_ids


def test_stop_strings(engine, model_and_tok):
    _, tok = model_and_tok
    p = tok.encode("next:4=")
    free = GenerationRequest("f", p, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    run_all(engine, [free])
    text = tok.decode(free.output_ids, skip_special_tokens=True)
    stop = text[2:4]
    r = GenerationRequest(
        "s", p, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, stop=[stop])
    )
    run_all(engine, [r])
    assert r.finish_reason == {"type": "stop", "matched": stop}
    assert stop in tok.decode(r.output_ids) and len(r.output_ids) <= text.index(stop) + len(stop)


def test_abort_while_running_and_queued(model_and_tok):
    model, tok = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1], max_running_requests=1)
    eng.start()
    try:
        long = GenerationRequest(
            "long", [3, 4], SamplingParams(temperature=0.0, max_new_tokens=100000, ignore_eos=True)
        )
        queued = GenerationRequest("queued", [3, 4], SamplingParams(temperature=0.0, max_new_tokens=4))
        eng.submit(long)
        eng.submit(queued)
        _wait_for(lambda: len(long.output_ids) > 2)
        assert eng.abort(abort_all=True) == 2
        assert long.wait(10) and queued.wait(10)
        assert long.finish_reason["type"] == "abort" and 2 < len(long.output_ids) < 100000
        assert queued.finish_reason["type"] == "abort" and queued.output_ids == []
    finally:
        eng.stop()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_requests_and_continue_finishes_them_identically(model_and_tok, mode):
    model, tok = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1])
    eng.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
        ref = GenerationRequest("ref", [5, 6, 7], params)
        run_all(eng, [ref])
        r = GenerationRequest("r", [5, 6, 7], params)
        eng.submit(r)
        _wait_for(lambda: len(r.output_ids) >= 1)
        parks = eng.stats.parks
        eng.pause(mode)
        assert eng.wait_parked(after=parks)  # the pause took effect: the worker waits, decoding nothing
        frozen = len(r.output_ids)
        assert not r.done and frozen < 60
        parks = eng.stats.parks
        late = GenerationRequest("late", [5, 6, 7], params)
        eng.submit(late)  # wakes the worker, which must go back to waiting without starting it
        assert eng.wait_parked(after=parks)
        assert late.output_ids == [] and len(r.output_ids) == frozen and not r.done
        eng.resume()
        run_all(eng, [])
        assert r.wait(30) and late.wait(30)
        assert r.output_ids == ref.output_ids and late.output_ids == ref.output_ids
    finally:
        eng.stop()


def test_exclusive_takes_the_model_between_decode_steps(model_and_tok):
    model, tok = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1])
    eng.start()
    try:
        r = GenerationRequest(
            "r", [3], SamplingParams(temperature=0.0, max_new_tokens=100000, ignore_eos=True)
        )
        eng.submit(r)
        _wait_for(lambda: len(r.output_ids) > 1)
        with eng.exclusive(wait_idle=False):
            n = len(r.output_ids)
            steps = eng.stats.generated_tokens
            # the worker finishes the step it was sampling, then blocks on the model: wait until a
            # decode step would have run many times over (a request on another engine is the clock)
            clock = GenerationEngine(model, eos_token_ids=[1])
            clock.start()
            try:
                tick = GenerationRequest("tick", [3], SamplingParams(temperature=0.0, max_new_tokens=20,
                                                                     ignore_eos=True))
                clock.submit(tick)
                assert tick.wait(30)
            finally:
                clock.stop()
            assert len(r.output_ids) <= n + 1 and eng.stats.generated_tokens <= steps + 1
        eng.abort("r")
        assert r.wait(10)
    finally:
        eng.stop()


def test_released_engine_refuses_requests(model_and_tok):
    model, _ = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1])
    eng.set_released(True)
    with pytest.raises(EngineUnavailable, match="resume_memory_occupation"):
        eng.submit(GenerationRequest("r", [3], SamplingParams()))


def test_top_k_and_top_p_restrict_the_sampled_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    top3 = set(logits[0].topk(3).indices.tolist())
    probs = torch.softmax(logits[1], -1)
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:nucleus_size].tolist())
    params = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    for _ in range(20):
        tokens, logprobs = sample_next_tokens(logits, params, gens)
        assert tokens[0].item() in top3
        assert tokens[1].item() in nucleus
        assert tokens[2].item() == logits[2].argmax().item()
        assert tokens[3].item() == logits[3].argmax().item()
        expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams.from_dict({"frequency_penalty": 0.5})
    p = SamplingParams.from_dict(
        {"temperature": 0, "top_k": 0, "stop": "##", "max_new_tokens": 3, "min_p": 0.0}
    )
    assert (p.temperature, p.top_k, p.stop, p.max_new_tokens) == (0.0, -1, ["##"], 3)


def _wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def test_concurrent_submitters_share_batches(model_and_tok):
    model, _ = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1], batch_wait_s=0.05)
    eng.start()
    try:
        reqs = [
            GenerationRequest(str(i), [3, i + 2], SamplingParams(temperature=0.0, max_new_tokens=3))
            for i in range(12)
        ]
        threads = [threading.Thread(target=eng.submit, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        run_all(eng, [])
        assert all(r.wait(30) for r in reqs)
        assert eng.stats.batches < len(reqs)
        assert eng.stats.max_batch_size > 1
    finally:
        eng.stop()


def test_requests_arriving_mid_batch_join_it_and_match_solo_results(model_and_tok):
    model, tok = model_and_tok
    eng = GenerationEngine(model, eos_token_ids=[1], batch_wait_s=0.0)
    eng.start()
    try:
        ps = prompts(tok)
        solo = [
            GenerationRequest(
                f"solo{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
            )
            for i, p in enumerate(ps)
        ]
        for r in solo:
            run_all(eng, [r])
        long = GenerationRequest(
            "long", [3, 4], SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
        )
        eng.submit(long)
        _wait_for(lambda: len(long.output_ids) > 3)
        late = [
            GenerationRequest(
                f"late{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
            )
            for i, p in enumerate(ps)
        ]
        run_all(eng, late)
        assert not long.done  # the late ones finished inside the long request's batch
        assert eng.stats.joined >= len(late) and eng.stats.batches == len(solo) + 1
        for s, r in zip(solo, late, strict=True):
            assert r.output_ids == s.output_ids
            torch.testing.assert_close(
                torch.tensor(r.output_logprobs), torch.tensor(s.output_logprobs), atol=1e-4, rtol=1e-4
            )
        assert long.wait(60) and len(long.output_ids) == 200
    finally:
        eng.stop()


class PoisonedModel(torch.nn.Module):
    """The tiny model, except that a prefill (a forward pass over more than one position) containing token
    ``poison`` raises (a request that breaks its prefill); ``fail_decodes`` makes that many single-token
    forward passes raise as well."""

    def __init__(self, model, poison: int):
        super().__init__()
        self.inner, self.poison, self.config = model, poison, model.config
        self.fail_decodes = 0
        # GenerationEngine reads forward's signature (the cache keyword's name): show the inner model's
        self.forward = functools.wraps(model.forward)(lambda input_ids=None, **kw: self._forward(input_ids, **kw))

    def _forward(self, input_ids=None, **kw):
        if input_ids.shape[1] > 1 and bool((input_ids == self.poison).any()):
            raise RuntimeError("poisoned token")
        if input_ids.shape[1] == 1 and self.fail_decodes > 0:
            self.fail_decodes -= 1
            raise RuntimeError("a decode step failed")
        return self.inner(input_ids=input_ids, **kw)

    def parameters(self, recurse: bool = True):
        return self.inner.parameters(recurse)


def test_a_request_that_breaks_its_prefill_fails_alone(model_and_tok):
    model, tok = model_and_tok
    poisoned = PoisonedModel(model, poison=13)
    eng = GenerationEngine(poisoned, eos_token_ids=[tok.eos_token_id], max_running_requests=16, seed=3)
    eng.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        long = [GenerationRequest(f"ok{i}", [3, 4, 5 + i], params) for i in range(3)]
        bad = GenerationRequest("bad", [3, 13, 4], params)
        run_all(eng, [*long[:2], bad])  # submitted together: one batch
        assert bad.finish_reason["type"] == "abort" and "prefill failed" in bad.finish_reason["message"]
        assert [r.finish_reason for r in long[:2]] == [{"type": "length", "length": 40}] * 2
        # joining a running batch: the bad newcomer fails, the running row goes on
        eng.submit(long[2])
        while not long[2].output_ids:
            assert not long[2].done
        late_bad = GenerationRequest("late-bad", [13, 3], params)
        eng.submit(late_bad)
        assert late_bad.wait(30) and late_bad.finish_reason["type"] == "abort"
        assert long[2].wait(30) and long[2].finish_reason == {"type": "length", "length": 40}
        assert eng.pending() == 0
    finally:
        eng.stop()


def test_a_failed_decode_step_retracts_the_rows_which_then_finish(model_and_tok):
    model, tok = model_and_tok
    poisoned = PoisonedModel(model, poison=10_000)
    eng = GenerationEngine(poisoned, eos_token_ids=[tok.eos_token_id], max_running_requests=16, seed=3)
    eng.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
        reference = [GenerationRequest(f"r{i}", [3, 4, 5 + i], params) for i in range(2)]
        run_all(eng, reference)
        poisoned.fail_decodes = 1
        again = [GenerationRequest(f"a{i}", [3, 4, 5 + i], params) for i in range(2)]
        run_all(eng, again)
        assert [r.output_ids for r in again] == [r.output_ids for r in reference]  # same tokens after re-prefill
        poisoned.fail_decodes = 10**6  # every decode fails: each row is answered after its second failure
        doomed = GenerationRequest("doomed", [3, 4], params)
        run_all(eng, [doomed])
        assert doomed.finish_reason["type"] == "abort" and "decode step failed" in doomed.finish_reason["message"]
    finally:
        eng.stop()
