"""An LLM judge on vLLM's CPU build: the judge's engine starts from the judge's recipe (a context that holds the
longest judge prompt) behind raygym's adapter; JudgeClient sends the rendered prompts in batches, greedily, and
its scores are what the judge model answered them, with no engine errors."""

from __future__ import annotations

import asyncio

import pytest

from raygym.config import Recipe
from raygym.engine_api.client import EngineClient
from raygym.engine_api.protocol import GenerateRequest, GenerateResponse
from raygym.engines.actor import EngineActor
from raygym.engines.launch.vllm import max_model_len
from raygym.rewards.judge import JudgeClient, JudgeSettings, parse_score, render_prompt
from raygym.run.aux_groups import judge_engine_recipe

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

CASES = [("next:1=", "2", "2"), ("next:5=", "6 or so", "6"), ("next:8=", "x" * 40, "9"), ("next:3=", "", None),
         ("next:7=", "8", "8")]


def test_a_vllm_judge_scores_what_its_model_answers(vllm_python, vllm_model, tmp_path):
    from transformers import AutoTokenizer

    recipe = Recipe(rollout_engine="vllm", rollout_engine_python=vllm_python, judge_hf_checkpoint=vllm_model,
                    judge_max_response_len=8, judge_batch_size=2, rollout_max_prompt_len=16,
                    rollout_max_response_len=48, eval_interval=None, colocate=False)
    settings = judge_engine_recipe(recipe, "vllm")
    tok = AutoTokenizer.from_pretrained(vllm_model)
    judge_settings = JudgeSettings.from_recipe(recipe)
    prompts = [render_prompt(judge_settings, tok, p, r, label) for p, r, label in CASES]
    assert max(len(ids) for ids in prompts) + 8 <= max_model_len(settings)  # the judge's context holds them all
    engine = EngineActor(settings, engine_index=0, model_path=vllm_model, gpu_ids=[], host="127.0.0.1",
                         backend="vllm", startup_timeout=600, log_dir=str(tmp_path / "logs"))
    engine.start()
    try:
        sent: list[GenerateRequest] = []
        answered: dict[tuple[int, ...], GenerateResponse] = {}

        class Recording:
            """The judge's engine client, keeping what went out and what came back."""

            def __init__(self, client: EngineClient) -> None:
                self.client = client

            async def generate(self, request: GenerateRequest):
                sent.append(request)
                answers = await self.client.generate(request)
                for ids, answer in zip(request.input_ids, answers, strict=True):
                    answered[tuple(ids)] = answer
                return answers

        async def judged() -> tuple[list[float], dict[str, float]]:
            async with EngineClient(engine.url()) as client:
                judge = JudgeClient(judge_settings, tok, clients=[Recording(client)])
                scores = await asyncio.gather(*(judge.score(p, r, label) for p, r, label in CASES))
                return list(scores), judge.metrics()

        scores, metrics = asyncio.run(judged())
        assert [len(r.input_ids) for r in sent] == [2, 2, 1]  # judge_batch_size prompts per /generate
        assert all(p == {"temperature": 0.0, "max_new_tokens": 8} for r in sent for p in r.sampling_params)
        answers = [answered[tuple(ids)] for ids in prompts]
        assert all(a.finish_type in ("stop", "length") and a.output_ids for a in answers)
        expected = [parse_score(a.text, recipe.judge_score_min, recipe.judge_score_max) for a in answers]
        assert scores == [recipe.judge_failure_score if e is None else e for e in expected]
        assert metrics["judge/requests"] == len(CASES) and metrics["judge/batches"] == 3
        assert metrics["judge/errors"] == 0 and metrics["judge/parse_failures"] == sum(e is None for e in expected)
    finally:
        engine.close()
