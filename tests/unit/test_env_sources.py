"""Environments and tasks from the ecosystem without engines: spec parsing, reasoning-gym data and scorers, the
chat-template token bridge, verifiers and raygym episodes against a scripted engine (token in / token out, errors
counted per episode), and the checks that stop a bad run before Ray starts."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from raygym import TrainConfig
from raygym.builtin import build_tokenizer
from raygym.data.prepare import PrepareOptions, prepare_dataset
from raygym.engine_api.protocol import GenerateResponse
from raygym.envs import Environment, EpisodeRunner, Step
from raygym.envs.chat_tokens import ChatTokens
from raygym.envs.openenv_env import action_field, observation_text
from raygym.envs.reasoning_gym_tasks import parse_task, reasoning_gym_reward, task_rows
from raygym.envs.specs import parse_env_spec
from raygym.errors import ConfigError, RaygymError
from raygym.rewards.scoring import RewardModel
from raygym.run.config_loading import load_train_config
from raygym.run.preflight import preflight
from raygym.types import Sample

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def merged_tokenizer():
    """The builtin character tokenizer plus a token for "12": the engine below samples "1" and "2" separately,
    which re-tokenising the text would merge, so a re-tokenising client cannot pass the token checks."""
    tok = build_tokenizer()
    tok.add_tokens(["12"])
    return tok


class ScriptedEngine:
    """``generate`` for the runners: answers every turn with the next scripted text, char by char (+ EOS), and
    records what it was sent and what it returned."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, list(answers)
        self.sent, self.returned = [], []

    async def __call__(self, ids, params):
        text = self.answers[len(self.sent) % len(self.answers)]
        out = [self.tok.convert_tokens_to_ids(ch) for ch in text] + [self.tok.eos_token_id]
        self.sent.append(list(ids))
        self.returned.append(out)
        return GenerateResponse.model_validate({
            "text": text, "output_ids": out, "meta_info": {
                "id": f"turn{len(self.sent)}", "prompt_tokens": len(ids), "completion_tokens": len(out),
                "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)],
                "finish_reason": {"type": "stop", "matched": self.tok.eos_token_id}}})


def model_tokens(sample):
    return [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m == 1]


# ── specs ────────────────────────────────────────────────────────────────────────────────────────────


def test_env_specs_parse_and_refuse_malformed_ones():
    spec = parse_env_spec("verifiers:owner/vf-gsm8k?num_train_examples=64&flag=true#eval")
    assert (spec.scheme, spec.target, spec.module, spec.options, spec.split) == (
        "verifiers", "owner/vf-gsm8k", "vf_gsm8k", {"num_train_examples": 64, "flag": True}, "eval")
    assert parse_env_spec("openenv:a.b.server:make_env?servers=2&stop=%3D").options == {"servers": 2, "stop": "="}
    assert parse_env_spec("my.module:Env") is None and parse_env_spec(None) is None
    for bad, needle in [("openenv:a.b?sessions=0", "sessions=0"), ("openenv:a.b?colour=1", "unknown option"),
                        ("verifiers:x#test", "no dataset split"), ("openenv:a b", "not a openenv environment"),
                        ("verifiers:x?novalue", "key=value")]:
        with pytest.raises(ConfigError, match=needle):
            parse_env_spec(bad)
    # the config accepts them (and only well-formed ones) and round-trips them through the CLI
    cfg = load_train_config(["--rollout-env", "openenv:a.b:app?sessions=4", "--rm-type", "env"])
    assert TrainConfig.from_cli_args(cfg.cli_args()) == cfg
    with pytest.raises(ConfigError, match="unknown option"):
        load_train_config(["--rollout-env", "openenv:a.b?bogus=1"])


# ── reasoning-gym ────────────────────────────────────────────────────────────────────────────────────


def test_reasoning_gym_rows_are_seeded_and_scored_by_the_tasks_own_scorer():
    pytest.importorskip("reasoning_gym")
    spec = parse_task("reasoning-gym:letter_counting?size=16&seed=3&min_words=1&max_words=3")
    rows = task_rows(spec)
    assert rows == task_rows(spec) and len(rows) == 16  # the same seed, the same rows
    assert rows != task_rows(parse_task("reasoning-gym:letter_counting?size=16&seed=4&min_words=1&max_words=3"))
    row = rows[0]
    assert row["metadata"]["reasoning_gym"]["task"] == "letter_counting" and row["label"] == row["metadata"][
        "reasoning_gym"]["entry"]["answer"]
    answer = row["label"]
    assert reasoning_gym_reward(f" {answer}\n", answer, row["metadata"]) == 1.0
    assert reasoning_gym_reward(f"so <answer>{answer}</answer>", answer, row["metadata"]) == 1.0
    assert reasoning_gym_reward(answer + "xyz", answer, row["metadata"]) == pytest.approx(len(answer) / (len(answer) + 3))
    assert reasoning_gym_reward("", answer, row["metadata"]) == 0.0
    sums = task_rows(parse_task("reasoning-gym:chain_sum?size=8&max_terms=2&max_digits=1"))
    assert all(reasoning_gym_reward(r["label"], r["label"], r["metadata"]) == 1.0 for r in sums)
    with pytest.raises(ValueError, match="metadata"):
        reasoning_gym_reward("1", "1", {})
    model = RewardModel(rm_type="reasoning_gym")  # the built-in rm_type reads the row's metadata
    sample = Sample(prompt=row["prompt"], prompt_tokens=[], group_index=0, response_text=answer, label=answer,
                    metadata=row["metadata"])
    asyncio.run(model.score([sample]))
    assert sample.reward == 1.0 and sample.reward_error is None


@pytest.mark.parametrize("uri, needle", [
    ("reasoning-gym:chain_sux", "did you mean 'chain_sum'"),
    ("reasoning-gym:chain_sum?colour=2", "no config field 'colour'"),
    ("reasoning-gym:chain_sum?min_terms=3&max_terms=2", "refused this config"),
    ("reasoning-gym:chain_sum?size=0", "size=0"),
    ("reasoning-gym:", "name a reasoning-gym task"),
])
def test_reasoning_gym_bad_uris_are_config_errors_before_ray(tmp_path, uri, needle):
    pytest.importorskip("reasoning_gym")
    cfg = load_train_config(["--prompt-data", uri, "--rm-type", "reasoning_gym", "--output-dir",
                                     str(tmp_path)])
    with pytest.raises(ConfigError, match=needle):
        preflight(cfg)


def test_data_prepare_generates_a_reasoning_gym_task_and_the_run_scores_it(tmp_path):
    pytest.importorskip("reasoning_gym")
    out = tmp_path / "rg"
    report = prepare_dataset(PrepareOptions(source="reasoning-gym:chain_sum?max_terms=2&max_digits=1",
                                            out_dir=str(out), size=50, seed=7, eval_size=10))
    assert (report.train_rows, report.eval_rows) == (40, 10)
    row = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    assert row["metadata"]["reasoning_gym"]["task"] == "chain_sum"
    assert reasoning_gym_reward(row["label"], row["label"], row["metadata"]) == 1.0
    facts = preflight(load_train_config(["--prompt-data", str(out / "train.jsonl"), "--rm-type",
                                                 "reasoning_gym", "--output-dir", str(tmp_path / "run")]))
    assert [f.name for f in facts.rewards] == ["reasoning_gym"] and facts.data.rows == 40
    other = tmp_path / "plain.jsonl"
    other.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    with pytest.raises(ConfigError, match="no metadata\\['reasoning_gym'\\]"):
        preflight(load_train_config(["--prompt-data", str(other), "--rm-type", "reasoning_gym",
                                             "--output-dir", str(tmp_path / "run2")]))
    with pytest.raises(ConfigError, match="drop --size"):
        PrepareOptions(source=str(other), out_dir=str(tmp_path / "x"), size=3).validate()


# ── the chat-template bridge ─────────────────────────────────────────────────────────────────────────


def test_chat_tokens_extend_the_context_with_only_the_new_messages():
    tok = merged_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    chat = ChatTokens(tok)
    assert chat.turn_closing == "<|im_end|>\n"
    prompt = chat.prompt_ids([{"role": "user", "content": "add"}])
    assert tok.decode(prompt) == "<|im_start|>user\nadd<|im_end|>\n<|im_start|>assistant\n"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    said = [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2"), end]  # "1","2": not the merged "12"
    following = chat.continuation_ids(said, [{"role": "tool", "content": "3"}])
    assert tok.decode(following) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"  # the model closed it
    truncated = chat.continuation_ids(said[:2], [{"role": "user", "content": "go"}])
    assert tok.decode(truncated).startswith("<|im_end|>\n<|im_start|>user")  # a cut turn gets the closing added
    # The context is the prompt, the engine's ids as they were, then the new ids: "1","2" stay two tokens.
    context = prompt + said + following
    assert context[len(prompt):len(prompt) + 3] == said
    assert tok.encode(tok.decode(context), add_special_tokens=False) != context  # what re-tokenising would give

    class Rewriting:  # a template that renders earlier assistant turns differently once more messages follow
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            return "".join(m["content"] if m is messages[-1] else m["content"].upper() for m in messages)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))

    with pytest.raises(RaygymError, match="re-tokenising"):
        ChatTokens(Rewriting()).continuation_ids([ord("a")], [{"role": "user", "content": "b"}])


# ── OpenEnv text mapping ─────────────────────────────────────────────────────────────────────────────


def test_openenv_action_and_observation_fields():
    schema = {"properties": {"message": {"type": "string"}, "metadata": {"type": "object"}}, "required": ["message"]}
    assert action_field(schema, None, "rollout_env") == "message"
    two = {"properties": {"code": {"type": "string"}, "lang": {"type": "string"}}, "required": ["code"]}
    assert action_field(two, None, "rollout_env") == "code" and action_field(two, "lang", "rollout_env") == "lang"
    with pytest.raises(ConfigError, match="\\?action=<field>"):
        action_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}, None, "rollout_env")
    with pytest.raises(ConfigError, match="no field 'x'"):
        action_field(schema, "x", "rollout_env")
    assert observation_text({"question": "next:3=", "turn": 1}, None) == "next:3="
    assert observation_text({"stdout": "4", "stderr": "", "exit_code": 0}, None) == "stdout: 4\nexit_code: 0\n"


# ── raygym's episode runner: errors stay in their episode ────────────────────────────────────────────


class Flaky(Environment):
    def __init__(self, fail_in: str, delay: float = 0.0) -> None:
        self.fail_in, self.delay = fail_in, delay
        self.closed = False

    def reset(self, prompt, label, metadata):
        if self.fail_in == "reset":
            raise KeyError("no such task")
        return "obs:"

    def step(self, action):
        time.sleep(self.delay)
        if self.fail_in == "step":
            raise RuntimeError("the tool crashed")
        return Step(observation="more:", reward=0.5, done=False)

    async def aclose(self):
        self.closed = True


@pytest.mark.parametrize("fail_in, delay, needle", [("reset", 0.0, "Flaky.reset raised KeyError"),
                                                    ("step", 0.0, "Flaky.step raised RuntimeError: the tool crashed"),
                                                    ("none", 2.0, "Flaky.step took longer than 0.3 s")])
def test_an_environment_that_raises_or_hangs_is_one_counted_episode_error(fail_in, delay, needle):
    tok = build_tokenizer()
    made = []

    def factory():
        made.append(Flaky(fail_in, delay))
        return made[-1]

    runner = EpisodeRunner(factory, tok, max_turns=3, call_timeout=0.3)
    engine = ScriptedEngine(tok, ["7"])
    sample = Sample(prompt="p", prompt_tokens=tok.encode("p"), group_index=0)
    async def timed():
        start = time.monotonic()
        episode = await runner(None, sample, {"max_new_tokens": 4}, engine)
        return episode, time.monotonic() - start

    out, seconds = asyncio.run(timed())
    assert seconds < 1.5  # the episode never waits for the hung step (only asyncio.run's exit waits for its thread)
    assert out.metrics["env_errors"] == 1.0 and needle in out.metadata["env_error"]
    assert out.metadata["env_reward"] == 0.0 and set(out.loss_mask) <= {0}  # nothing of it is trained
    assert len(out.loss_mask) == len(out.response_tokens) and made[0].closed
    healthy = asyncio.run(EpisodeRunner(lambda: Flaky("none"), tok, max_turns=2)(
        None, Sample(prompt="p", prompt_tokens=tok.encode("p"), group_index=0), {"max_new_tokens": 4},
        ScriptedEngine(tok, ["7"])))
    assert healthy.metrics["env_errors"] == 0.0 and healthy.metadata["env_reward"] == 1.0
    assert tok.decode(healthy.response_tokens, skip_special_tokens=True) == "obs:7more:7"  # reset's observation first


# ── verifiers, against a scripted engine ─────────────────────────────────────────────────────────────


def vf_runner(target, tok, **kw):
    pytest.importorskip("verifiers")
    from raygym.envs.verifiers_env import VerifiersRunner

    return VerifiersRunner(parse_env_spec(f"verifiers:{target}"), tok, max_turns=4, max_context_len=None, **kw)


def run_group(runner, rows, engine, n=2):
    async def play():
        samples = [await runner(None, Sample(prompt=rows[0]["prompt"], prompt_tokens=[], group_index=0, sample_index=j,
                                             label=rows[0]["label"], metadata=dict(rows[0]["metadata"])),
                                {"max_new_tokens": 6}, engine) for j in range(n)]
        return samples, await runner.verifiers_rubric(samples)
    return asyncio.run(play())


def test_verifiers_multi_turn_episodes_keep_the_engines_token_ids():
    tok = merged_tokenizer()
    runner = vf_runner("vf_fixture_envs:multi_turn", tok)
    from raygym.envs.verifiers_env import environment_rows

    rows = environment_rows(runner.env)
    engine = ScriptedEngine(tok, ["12"])
    samples, rewards = run_group(runner, rows, engine)
    sample = samples[0]
    assert sample.metrics["env_turns"] == 3 and sample.metrics["env_errors"] == 0.0
    assert model_tokens(sample) == [t for out in engine.returned[:3] for t in out]  # the engine's ids, unmerged
    assert sample.rollout_log_probs[:3] == pytest.approx([-0.1, -0.2, -0.3])
    # every turn's input was the previous input plus the engine's answer plus the environment's message only
    for before, after, out in zip(engine.sent, engine.sent[1:3], engine.returned, strict=False):
        assert after[:len(before) + len(out)] == before + out
    assert sample.prompt_tokens + sample.response_tokens[:-len(engine.returned[2])] == engine.sent[2]
    retokenised = tok.encode(tok.decode(sample.response_tokens), add_special_tokens=False)
    assert retokenised != sample.response_tokens  # the check above could fail for a re-tokenising client
    assert rewards == [pytest.approx(1.0)] * 2 and sample.metadata["env_reward"] == pytest.approx(1.0)
    assert sample.metrics["verifiers/says_twelve"] == 1.0 and "verifiers_rollout" not in sample.metadata


def test_verifiers_single_turn_and_failing_environments():
    tok = build_tokenizer()
    single = vf_runner("vf_fixture_envs:single_turn", tok)
    from raygym.envs.verifiers_env import environment_rows, load_environment

    samples, rewards = run_group(single, environment_rows(single.env), ScriptedEngine(tok, ["4", "5"]))
    assert [s.metrics["env_turns"] for s in samples] == [1.0, 1.0] and rewards == [1.0, 0.0]
    broken = vf_runner("vf_fixture_envs:broken_env_response", tok)
    samples, rewards = run_group(broken, environment_rows(broken.env), ScriptedEngine(tok, ["4"]))
    assert all(s.metrics["env_errors"] == 1.0 and "env_response exploded" in s.metadata["env_error"] for s in samples)
    assert rewards == [0.0, 0.0] and all(set(s.loss_mask) == {0} for s in samples)

    async def dead_engine(ids, params):
        raise RaygymError("every engine is down")

    with pytest.raises(RaygymError, match="every engine is down"):  # the manager's to handle, not an env error
        run_group(single, environment_rows(single.env), dead_engine, n=1)
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_environment(parse_env_spec("verifiers:vf_fixture_envs:nope"))
    with pytest.raises(ConfigError, match="building the environment raised"):
        load_environment(parse_env_spec("verifiers:vf_fixture_envs:raises_on_load"))
    with pytest.raises(ConfigError, match="not a verifiers Environment"):
        load_environment(parse_env_spec("verifiers:vf_fixture_envs:not_an_env"))


def test_missing_packages_name_the_extra(monkeypatch):
    import sys

    from raygym.envs.verifiers_env import load_environment

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'raygym\[verifiers\]'"):
        load_environment(parse_env_spec("verifiers:reverse-text"))
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    from raygym.envs.openenv_server import resolve_target

    with pytest.raises(ConfigError, match=r"pip install 'raygym\[openenv\]'"):
        resolve_target("examples.openenv_env.server", "app")
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(ConfigError, match=r"pip install 'raygym\[reasoning-gym\]'"):
        task_rows(parse_task("reasoning-gym:chain_sum"))
