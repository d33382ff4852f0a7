"""An OpenEnv environment, written the way OpenEnv's environment packages write them: pydantic action and
observation models, an ``Environment`` subclass and the server's ``app`` from OpenEnv's ``create_app``. raygym
starts this server itself and plays each episode as one WebSocket session (``--rollout-env
openenv:examples.openenv_env.server:app``; see examples/openenv_env/README.md).

The task counts up: ``reset(seed)`` shows ``next:d=`` (``d`` from the seed); each answer is scored (0.25 for a
digit, 0.5 more for ``d + 1``, 0.25 more for answering with that one character only; divided by the number of
questions, so an episode's rewards add up to at most 1.0) and the next question asks for the digit after
``d + 1``. The episode is done after ``QUESTIONS`` answers.

Run it alone: ``python -m examples.openenv_env.server --port 8000``.
"""

from __future__ import annotations

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

QUESTIONS = 3


class CountAction(Action):
    """The model's answer."""

    message: str = Field(..., description="The answer to the last question")


class CountObservation(Observation):
    """The next question ("" once the episode is done)."""

    question: str = Field(default="", description="What the model is asked next")


class CountingEnvironment(Environment):
    """Counts up from a seeded digit; every episode is its own instance, so sessions may run side by side."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.digit = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> CountObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.digit = (seed or 0) % 10
        return CountObservation(question=f"next:{self.digit}=", reward=0.0, done=False)

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs) -> CountObservation:
        self._state.step_count += 1
        want = str((self.digit + 1) % 10)
        text = action.message.strip()
        score = 0.0
        if text[:1].isdigit():
            score = 0.25 + (0.5 if text[0] == want else 0.0) + (0.25 if len(text) == 1 else 0.0)
        self.digit = (self.digit + 1) % 10
        done = self._state.step_count >= QUESTIONS
        return CountObservation(question="" if done else f"\nnext:{self.digit}=", reward=score / QUESTIONS, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountingEnvironment, CountAction, CountObservation, env_name="counting", max_concurrent_envs=64)


if __name__ == "__main__":
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port)
