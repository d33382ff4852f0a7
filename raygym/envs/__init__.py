"""Multi-turn, tool-using environments (see :mod:`raygym.envs.base` for the protocol and
:mod:`raygym.envs.runner` for how episodes run through the engines)."""

from raygym.envs.base import Environment, Step
from raygym.envs.runner import EpisodeRunner, episode_reward

__all__ = ["Environment", "EpisodeRunner", "Step", "episode_reward"]
