"""Environments, the LLM judge and the distillation teacher against a real raygym server (tiny model,
CPU, real HTTP), without Ray: episodes token in / token out with masks and limits, many in flight;
judge parsing, batching and cache; teacher log-probs that line up with the engine's own."""

from __future__ import annotations

import asyncio

import pytest
import torch

from raygym.builtin import build_tokenizer
from raygym.config import Recipe
from raygym.engine_api.client import EngineClient
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.envs import Environment, EpisodeRunner, Step
from raygym.presets import tiny
from raygym.rewards.distill import TeacherActor, distill_advantages, reverse_kl_per_token
from raygym.rewards.judge import JudgeClient, JudgeSettings
from raygym.rollout.tasks import sample_metrics
from raygym.trainer.batch import TrainBatch
from raygym.types import Sample


@pytest.fixture(scope="module")
def engine_url(tiny_model_path, tmp_path_factory):
    actor = EngineActor(tiny().replace(seed=3, sglang_max_running_requests=64), 0, tiny_model_path, [], "127.0.0.1",
                        "raygym", startup_timeout=180.0, device="cpu", log_dir=str(tmp_path_factory.mktemp("logs")))
    url = actor.start()
    yield url
    actor.close()


class Scripted(Environment):
    """Answers every turn with a fixed observation; done after ``stop_after`` turns."""

    turn_stop = ("=",)

    def __init__(self, observation: str = "obs:12\n", stop_after: int = 99) -> None:
        self.observation, self.stop_after = observation, stop_after

    def reset(self, prompt, label, metadata):
        self.turns = []

    def step(self, action):
        self.turns.append(action)
        return Step(observation=self.observation, reward=0.25, done=len(self.turns) >= self.stop_after,
                    tool_call=action.endswith("="), tool_error=not action.strip())


class NoStop(Scripted):
    turn_stop = ()


def sample_for(tok, text: str) -> Sample:
    return Sample(prompt=text, prompt_tokens=tok.encode(text, add_special_tokens=False), group_index=0)


def test_episodes_token_in_token_out_with_masks_limits_and_many_in_flight(engine_url):
    tok = build_tokenizer()

    async def scenario():
        async with EngineClient(engine_url) as client:
            sent: list[list[int]] = []
            answers: list[dict] = []

            async def generate(input_ids, params):
                sent.append(list(input_ids))
                out = await client.generate(GenerateRequest.model_validate({"input_ids": input_ids, "sampling_params": params,
                                             "return_logprob": True}))
                answers.append(out)
                return out

            runner = EpisodeRunner(lambda: Scripted(), tok, max_turns=3)
            one = await runner(None, sample_for(tok, "next:3="), {"max_new_tokens": 5, "temperature": 1.0}, generate)
            before = (await client.stats())
            many = await asyncio.gather(*(
                EpisodeRunner(lambda: NoStop(), tok, max_turns=2)(
                    None, sample_for(tok, f"next:{i % 10}="), {"max_new_tokens": 6, "ignore_eos": True}, client_generate(client))
                for i in range(24)))
            after = await client.stats()
            limited = await EpisodeRunner(lambda: NoStop("o" * 40), tok, max_turns=5, max_context_len=40)(
                None, sample_for(tok, "next:1="), {"max_new_tokens": 8, "ignore_eos": True}, generate)
            return one, sent, answers, before, after, many, limited

    one, sent, answers, before, after, many, limited = asyncio.run(asyncio.wait_for(scenario(), 120))
    # Turn k's input is exactly the prompt plus everything so far: nothing re-tokenised.
    observation = tok.encode("obs:12\n", add_special_tokens=False)
    expected_tokens, expected_mask, expected_lps = [], [], []
    for k, answer in enumerate(answers[:3]):
        assert sent[k] == one.prompt_tokens + expected_tokens
        out = [int(e[1]) for e in answer["meta_info"]["output_token_logprobs"]]
        expected_tokens += out
        expected_mask += [1] * len(out)
        expected_lps += [float(e[0]) for e in answer["meta_info"]["output_token_logprobs"]]
        if k < 2:
            expected_tokens += observation
            expected_mask += [0] * len(observation)
            expected_lps += [0.0] * len(observation)
    assert len(sent) == 3 + 1  # 3 turns, then the context-limited episode's first request
    assert one.response_tokens[: len(expected_tokens)] == expected_tokens
    assert one.loss_mask == expected_mask and one.rollout_log_probs == expected_lps
    assert one.metrics["env_turns"] == 3 and one.metadata["env_reward"] == 0.75
    # 24 episodes of 2 turns ran at the same time: the server batched requests of different episodes.
    assert all(s.metrics["env_turns"] == 2 and len(s.response_tokens) == 6 + 7 + 6 for s in many)
    assert after["max_batch_size"] >= 8 and after["requests_finished"] - before["requests_finished"] == 48
    # The context limit: prompt + response never exceed 40 tokens; the cut observation ends the episode.
    assert len(limited.prompt_tokens) + len(limited.response_tokens) == 40
    assert limited.finish_reason == "length" and limited.metrics["env_context_full"] == 1.0
    assert len(limited.loss_mask) == len(limited.response_tokens)
    metrics = sample_metrics(many)
    assert metrics["rollout/env_turns"] == 2.0 and metrics["rollout/env_tool_calls"] >= 0.0


def client_generate(client):
    async def generate(input_ids, params):
        return await client.generate(GenerateRequest.model_validate({"input_ids": input_ids, "sampling_params": params, "return_logprob": True}))
    return generate


def test_judge_parses_batches_and_caches(engine_url):
    tok = build_tokenizer()
    settings = JudgeSettings.from_recipe(Recipe(
        judge_prompt_template="{prompt}{response}\nscore 0-9:", judge_max_response_len=4, judge_score_min=0.0,
        judge_score_max=9.0, judge_failure_score=-1.0, judge_batch_size=8))
    samples = [Sample(prompt=f"next:{i}=", prompt_tokens=[], group_index=0, response_text=str(i % 10))
               for i in range(20)]

    async def scenario():
        async with EngineClient(engine_url) as client:
            judge = JudgeClient(settings, tok, clients=[client])
            first = await judge.score_samples(samples)
            m1 = judge.metrics()
            again = await judge.score_samples(samples)
            m2 = judge.metrics()
            fresh = JudgeClient(settings, tok, clients=[client])
            recomputed = await fresh.score_samples(samples[:5])
            return first, m1, again, m2, recomputed

    first, m1, again, m2, recomputed = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert all(v == -1.0 or 0.0 <= v <= 1.0 for v in first)
    assert m1["judge/requests"] == 20 and m1["judge/batches"] == 3  # 20 prompts in batches of at most 8
    assert m1["judge/parse_failures"] == sum(v == -1.0 for v in first)
    assert again == first and m2["judge/cache_hits"] == 20 and m2["judge/requests"] == 0
    assert recomputed == first[:5]  # greedy: the judge is deterministic


def test_teacher_log_probs_line_up_with_the_engines(engine_url, tiny_model_path):
    """The teacher is the policy itself here, so its log-probs must equal the engine's sampling log-probs."""
    tok = build_tokenizer()

    async def sample_some():
        async with EngineClient(engine_url) as client:
            return await client.generate(GenerateRequest.model_validate({"input_ids": [tok.encode(f"next:{i}=") for i in range(4)],
                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0.7,
                                                              "ignore_eos": True},
                                          "return_logprob": True}))

    outputs = asyncio.run(sample_some())
    teacher = TeacherActor(tiny_model_path, device="cpu", max_tokens_per_batch=30)  # forces several batches
    prompts = [tok.encode(f"next:{i}=") for i in range(4)]
    responses = [[int(e[1]) for e in o["meta_info"]["output_token_logprobs"]] for o in outputs]
    engine_lps = [[float(e[0]) for e in o["meta_info"]["output_token_logprobs"]] for o in outputs]
    scored = teacher.log_probs([p + r for p, r in zip(prompts, responses, strict=True)],
                               [len(p) for p in prompts], temperature=0.7)
    for got, want in zip(scored, engine_lps, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
        assert reverse_kl_per_token(want, got, [1] * len(got)) == pytest.approx([0.0] * len(got), abs=1e-4)


def test_distill_advantages_mix_the_task_and_the_reverse_kl():
    s1 = Sample(prompt="a", prompt_tokens=[3], group_index=0, response_tokens=[4, 5, 6], reward=1.0,
                rollout_log_probs=[-1.0, -2.0, -0.5], loss_mask=[1, 0, 1], teacher_log_probs=[-0.5, -9.0, -1.5])
    s2 = Sample(prompt="a", prompt_tokens=[3], group_index=0, response_tokens=[4], reward=0.0,
                rollout_log_probs=[-1.0], teacher_log_probs=[-1.0])
    batch = TrainBatch.from_samples([s1, s2]).with_advantages("grpo")
    task = [a.clone() for a in batch.advantages]
    mixed = distill_advantages(batch, [s1, s2], kl_coef=2.0, task_weight=0.5)
    assert torch.allclose(mixed.advantages[0], torch.tensor([0.5 * task[0][0] + 2.0 * 0.5, 0.0,
                                                            0.5 * task[0][2] + 2.0 * -1.0]))
    assert torch.allclose(mixed.advantages[1], 0.5 * task[1])
    pure = distill_advantages(batch, [s1, s2], kl_coef=1.0, task_weight=0.0)
    assert pure.advantages[0].tolist() == [0.5, 0.0, -1.0]
    metrics = sample_metrics([s1, s2])
    assert metrics["rollout/distill_reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
