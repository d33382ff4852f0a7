"""A weight update that lands while a request is generating, on an engine whose answers carry one weight version
(stock SGLang, vLLM): the sync's pause aborts the request, which comes back with its tokens so far; raygym
continues it on the new weights (the rollout manager's continuation request); the two parts carry their own
versions and each part's log-probs are its own weights' (checked against the trainer before and after the
update). Shared by tests/sglang_cpu and tests/vllm_cpu."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from raygym.engine_api.protocol import GenerateRequest
from raygym.rollout.responses import continuation_params, token_versions
from raygym.types import Sample

PROMPT = [3, 4, 5, 6]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll an engine counter until ``condition`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def mean_abs(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _generate_across_a_push(engine: Any, sync: Any, trainer: Any, version: int, running: Callable[[], bool],
                            params: dict[str, Any]) -> Any:
    """One request generating while ``version + 1`` is pushed; its answer (aborted by the push's pause, or
    finished when the pause came too late)."""
    answer: dict[str, Any] = {}

    def generate() -> None:
        request = {"input_ids": [PROMPT], "sampling_params": [params], "return_logprob": True}
        answer["r"] = engine.generate(GenerateRequest.model_validate(request))[0]

    trainer.train_step()  # version + 1, pushed once the request runs
    thread = threading.Thread(target=generate)
    thread.start()
    wait_until(running, "the request to run in the engine")
    sync.push(version + 1)  # pauses by aborting: the request comes back with what it generated so far
    thread.join(120)
    return answer["r"]


def assert_update_mid_generation_splits_versions(engine: Any, sync: Any, trainer: Any, version: int,
                                                 running: Callable[[], bool], tolerance: float = 0.05,
                                                 max_new_tokens: int = 200, attempts: int = 3) -> None:
    """``engine`` (an EngineActor) serves ``version`` from ``trainer``; ``running()`` says a request is in the
    engine. Pushes ``version + 1`` while one generates (``max_new_tokens`` long enough to still run when the push
    starts) and checks both parts.

    On a loaded machine the push may reach its pause only after the request finished: then nothing was split, the
    case under test did not happen, and it is set up again on the next version (at most ``attempts`` times)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 17}
    missed = []
    for _ in range(attempts):
        before = copy.deepcopy(trainer.model)
        first = _generate_across_a_push(engine, sync, trainer, version, running, params)
        if first.finish_type == "abort":
            break
        assert first.finish_type == "length", first["meta_info"]["finish_reason"]
        missed.append(version)
        version += 1  # the engine serves version + 1 now: try again from there
    else:
        raise AssertionError(f"the request finished before the pause of every push (versions {missed})")
    meta = first["meta_info"]
    sample = Sample(prompt="", prompt_tokens=list(PROMPT), group_index=0)
    sample.response_tokens = [int(t) for _, t, _ in meta["output_token_logprobs"]]
    sample.rollout_log_probs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
    sample.token_versions = token_versions(meta, sample.response_length, -1)
    assert 0 < sample.response_length < max_new_tokens and set(sample.token_versions) == {version}

    rest = engine.generate(GenerateRequest.model_validate({"input_ids": [PROMPT + sample.response_tokens], "return_logprob": True,
                            "sampling_params": [continuation_params(sample, params, 1)]}))[0]
    rest_meta = rest["meta_info"]
    assert rest.finish_type == "length"
    tail = [int(t) for _, t, _ in rest_meta["output_token_logprobs"]]
    tail_lp = [float(lp) for lp, _, _ in rest_meta["output_token_logprobs"]]
    tail_versions = token_versions(rest_meta, len(tail), -1)
    assert sample.response_length + len(tail) == max_new_tokens and set(tail_versions) == {version + 1}

    after = trainer.model
    head_want_old = probe(before, PROMPT, sample.response_tokens)
    tail_want_new = probe(after, PROMPT + sample.response_tokens, tail)
    tail_want_old = probe(before, PROMPT + sample.response_tokens, tail)
    assert mean_abs(sample.rollout_log_probs, head_want_old) < tolerance
    assert mean_abs(tail_lp, tail_want_new) < tolerance
    # the tail really came from the new weights: the old ones score it clearly worse than the new ones do
    assert mean_abs(tail_lp, tail_want_old) > 2 * mean_abs(tail_lp, tail_want_new)


def probe(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()
