"""OpenEnv and verifiers environments against a real engine (raygym's server) and real OpenEnv servers: every
trained token is one the engine generated (token in / token out across turns), many episodes run at once, and an
environment that fails costs only its own episode."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from raygym.builtin import build_tokenizer
from raygym.engine_api.client import EngineClient
from raygym.engine_api.protocol import GenerateRequest
from raygym.engines.actor import EngineActor
from raygym.envs import EpisodeRunner
from raygym.envs.specs import parse_env_spec
from raygym.presets import tiny
from raygym.rollout.tasks import sample_metrics
from raygym.trainer.batch import TrainBatch
from raygym.types import Sample

pytest.importorskip("openenv.core")
pytest.importorskip("verifiers")
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def engine_url(tiny_model_path, tmp_path_factory):
    actor = EngineActor(tiny().replace(seed=5, sglang_max_running_requests=64), 0, tiny_model_path, [], "127.0.0.1",
                        "raygym", startup_timeout=180.0, device="cpu", log_dir=str(tmp_path_factory.mktemp("logs")))
    url = actor.start()
    yield url
    actor.close()


class Recorder:
    """The rollout manager's ``generate`` for one episode runner, recording each answer's output ids."""

    def __init__(self, client):
        self.client, self.outputs = client, {}

    def for_sample(self, key):
        async def generate(input_ids, params):
            out = await self.client.generate(GenerateRequest.model_validate({"input_ids": input_ids, "sampling_params": params,
                                              "return_logprob": True}))
            self.outputs.setdefault(key, []).append([int(e[1]) for e in out["meta_info"]["output_token_logprobs"]])
            return out
        return generate


def assert_trained_tokens_are_generated(samples, outputs):
    batch = TrainBatch.from_samples(samples, group_size=len(samples))
    for i, sample in enumerate(samples):
        trained = [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m]
        assert trained == [t for out in outputs[i] for t in out]
        assert batch.tokens[i].tolist() == sample.prompt_tokens + sample.response_tokens
        mask = batch.loss_masks[i].tolist()
        picked = [t for t, m in zip(batch.tokens[i].tolist()[len(sample.prompt_tokens):], mask, strict=True) if m]
        assert picked == trained


def test_openenv_environments_served_by_raygym(engine_url, monkeypatch):
    from raygym.envs.openenv_env import OpenEnvPool

    monkeypatch.setenv("PYTHONPATH", f"{HERE}:{Path.cwd()}")  # the servers import this folder's environments
    monkeypatch.syspath_prepend(str(HERE))
    tok = build_tokenizer()

    async def scenario():
        echo = OpenEnvPool(parse_env_spec("openenv:openenv_fixture_envs:Echo?sessions=8"))
        crashy = OpenEnvPool(parse_env_spec("openenv:openenv_fixture_envs:Crashy?servers=2"))  # 2 x 1 session
        try:
            async with EngineClient(engine_url) as client:
                record = Recorder(client)
                samples = [Sample(prompt="go\n", prompt_tokens=tok.encode("go\n"), group_index=0,
                                  metadata={"seed": i}) for i in range(16)]
                runner = EpisodeRunner(echo, tok, max_turns=4)
                done = await asyncio.gather(*(runner(None, s, {"max_new_tokens": 5, "temperature": 1.0},
                                                     record.for_sample(i)) for i, s in enumerate(samples)))
                crashed = await asyncio.gather(*(
                    EpisodeRunner(crashy, tok, max_turns=4)(
                        None, Sample(prompt="go\n", prompt_tokens=tok.encode("go\n"), group_index=0,
                                     metadata={"seed": i}), {"max_new_tokens": 5}, record.for_sample(100 + i))
                    for i in range(6)))
                return done, record.outputs, crashed, echo.sessions
        finally:
            await echo.aclose()
            await crashy.aclose()

    done, outputs, crashed, sessions = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert sessions == 8
    assert all(s.metrics["env_turns"] == 3 and s.metadata["env_reward"] == 3.0 for s in done)
    assert tok.decode(done[3].response_tokens).startswith("go3:")  # reset's observation, from the row's seed
    assert_trained_tokens_are_generated(done, [outputs[i] for i in range(16)])
    errors = [s.metrics["env_errors"] for s in crashed]
    assert errors == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # odd seeds crash in their second step; the rest finish
    assert all("the simulator crashed" in s.metadata["env_error"] for s in crashed[1::2])
    assert all(s.metadata["env_reward"] == 3.0 for s in crashed[::2])
    assert sample_metrics(crashed)["rollout/env_errors"] == 0.5


def test_verifiers_environment_through_the_engine(engine_url, monkeypatch):
    from raygym.envs.verifiers_env import VerifiersRunner, environment_rows

    monkeypatch.syspath_prepend(str(HERE.parent / "unit"))
    tok = build_tokenizer()
    runner = VerifiersRunner(parse_env_spec("verifiers:vf_fixture_envs:multi_turn"), tok, max_turns=4,
                             max_context_len=60)
    row = environment_rows(runner.env)[0]

    async def scenario():
        async with EngineClient(engine_url) as client:
            record = Recorder(client)
            samples = [Sample(prompt=row["prompt"], prompt_tokens=[], group_index=0, sample_index=j,
                              label=row["label"], metadata=dict(row["metadata"])) for j in range(8)]
            done = await asyncio.gather(*(runner(None, s, {"max_new_tokens": 6, "temperature": 1.0},
                                                 record.for_sample(j)) for j, s in enumerate(samples)))
            rewards = await runner.verifiers_rubric(list(done))
            return done, rewards, record.outputs

    done, rewards, outputs = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert all(1 <= s.metrics["env_turns"] <= 3 for s in done)
    assert all(len(s.prompt_tokens) + len(s.response_tokens) <= 60 for s in done)
    assert tok.decode(done[0].prompt_tokens) == "q0:"  # the environment's prompt, through the chat template
    assert_trained_tokens_are_generated(done, [outputs[j] for j in range(8)])
    assert rewards == [s.metadata["env_reward"] for s in done] and all(0.0 <= r <= 1.0 for r in rewards)
