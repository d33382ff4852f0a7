"""A multi-turn ``verifiers`` environment, written the way the Environments Hub writes them: a module with
``load_environment(**kwargs)`` returning a ``vf.MultiTurnEnv`` with its dataset, parser and rubric. raygym runs it
unchanged (``--rollout-env verifiers:examples.verifiers_env.env``; see examples/verifiers_env/README.md).

The task counts up: the prompt asks for the digit after ``d`` (``next:3=``); after each answer the environment asks
for the digit after the next one (``next:4=``, then ``next:5=``), three questions per episode. The rubric scores the
answers (the parser keeps each answer's first character): per question 0.25 for a digit, 0.5 more for the right
one, 0.25 more for answering with that one character only; the episode's reward is the mean over the questions it
asked.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def first_char(text: str) -> str:
    return text.strip()[:1]


def _content(message) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else ""


def counting_score(completion, answer, parser) -> float:
    """The rubric's reward: the mean shaped score of the episode's answers (question k asks about answer + k)."""
    answers = parser.get_assistant_messages(completion)
    if not answers:
        return 0.0
    total = 0.0
    for k, message in enumerate(answers):
        digit = (int(answer) + k) % 10
        text = _content(message).strip()
        if not text or not text[0].isdigit():
            continue
        total += 0.25 + (0.5 if text[0] == str((digit + 1) % 10) else 0.0) + (0.25 if len(text) == 1 else 0.0)
    return total / len(answers)


class CountingEnv(vf.MultiTurnEnv):
    """Asks for the next digit, then for the one after it, ``max_turns`` questions in all."""

    async def env_response(self, messages, state, **kwargs):
        asked = (int(state["answer"]) + len(state["trajectory"])) % 10
        return [vf.UserMessage(content=f"\nnext:{asked}=")]


def load_environment(num_examples: int = 1024, max_turns: int = 3, seed: int = 0) -> vf.Environment:
    rng = random.Random(seed)
    digits = [rng.randrange(10) for _ in range(num_examples)]
    dataset = Dataset.from_list([{"question": f"next:{d}=", "answer": str(d)} for d in digits])
    eval_dataset = Dataset.from_list([{"question": f"next:{d}=", "answer": str(d)} for d in range(10)])
    parser = vf.Parser(extract_fn=first_char)
    rubric = vf.Rubric(funcs=[counting_score], weights=[1.0], parser=parser)
    return CountingEnv(dataset=dataset, eval_dataset=eval_dataset, parser=parser, rubric=rubric,
                       max_turns=max_turns)
