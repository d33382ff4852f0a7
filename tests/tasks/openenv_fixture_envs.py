"""OpenEnv environments for tests/tasks/test_ecosystem_envs.py, served by raygym from their classes (no app)."""

from __future__ import annotations

from openenv.core.env_server import Action, Environment, Observation, State


class SayAction(Action):
    text: str


class HeardObservation(Observation):
    heard: str = ""


class Echo(Environment):
    """Repeats what it heard; reward 1 per turn; done after three turns."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> HeardObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return HeardObservation(heard=f"go{(seed or 0) % 10}:", reward=0.0)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs) -> HeardObservation:
        self._state.step_count += 1
        return HeardObservation(heard=f"\nheard {len(action.text)}:", reward=1.0, done=self._state.step_count >= 3)

    @property
    def state(self) -> State:
        return self._state


class Crashy(Echo):
    """Raises in its second step when the seed is odd."""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> HeardObservation:
        self.odd = bool((seed or 0) % 2)
        return super().reset(seed, episode_id)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs) -> HeardObservation:
        if self.odd and self._state.step_count == 1:
            raise RuntimeError("the simulator crashed")
        return super().step(action)
