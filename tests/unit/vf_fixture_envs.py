"""verifiers environments for tests/unit/test_env_sources.py and tests/tasks/test_ecosystem_envs.py (the classic
verifiers API, as environment authors write it)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _text(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else ""


def says_twelve(completion, parser) -> float:
    answers = parser.get_assistant_messages(completion)
    return sum(_text(m).strip() == "12" for m in answers) / max(len(answers), 1)


def is_answer(completion, answer, parser) -> float:
    return float(parser.parse_answer(completion) == answer)


class Asks(vf.MultiTurnEnv):
    """Asks again after every answer: "again:" as a user turn."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"again{len(state['trajectory'])}:")]


class Explodes(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise ValueError("env_response exploded")


def _data(n: int = 4):
    return Dataset.from_list([{"question": f"q{i}:", "answer": "4"} for i in range(n)])


def multi_turn(max_turns: int = 3) -> vf.Environment:
    parser = vf.Parser(extract_fn=str.strip)
    return Asks(dataset=_data(), parser=parser, rubric=vf.Rubric(funcs=[says_twelve], parser=parser),
                max_turns=max_turns)


def single_turn() -> vf.Environment:
    parser = vf.Parser(extract_fn=str.strip)
    return vf.SingleTurnEnv(dataset=_data(), parser=parser, rubric=vf.Rubric(funcs=[is_answer], parser=parser))


def broken_env_response() -> vf.Environment:
    parser = vf.Parser()
    return Explodes(dataset=_data(), parser=parser, rubric=vf.Rubric(funcs=[is_answer], parser=parser), max_turns=3)


def raises_on_load() -> vf.Environment:
    raise FileNotFoundError("the dataset is on a hub this machine cannot reach")


def not_an_env() -> dict:
    return {"not": "an environment"}
