"""The multi-turn environment protocol: pure Python, no Ray, no torch.

An episode starts from one prompt row (``reset`` may answer with a first observation, appended after the prompt as
NOT-trained tokens); the model takes a turn (its tokens end at a ``turn_stop``
string, the end-of-sequence token or the turn's token budget); the environment answers with a
:class:`Step`: an observation (tool output, a user turn; appended to the context as NOT-trained
tokens), a reward and whether the episode is done. :mod:`raygym.envs.runner` drives episodes token
in / token out through the engines.

>>> class Echo(Environment):
...     def reset(self, prompt, label, metadata): self.turns = 0
...     def step(self, action):
...         self.turns += 1
...         return Step(observation=f"you said {action}\\n", done=self.turns == 2, reward=1.0)
>>> env = Echo(); env.reset("hi", None, {}); env.step("a").observation
'you said a\\n'
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Step:
    """The environment's answer to one model turn.

    ``observation`` is appended after the turn ("" = nothing); its tokens are masked out of the loss.
    ``reward`` is added to the episode's reward. ``tool_call`` / ``tool_error`` count into the
    ``rollout/env_tool_calls`` / ``rollout/env_tool_errors`` metrics.
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False


class Environment:
    """One episode's state. Subclass it and override :meth:`reset` and :meth:`step` (either may be
    ``async``). ``turn_stop``: strings that end a model turn besides the end-of-sequence token (the
    engine stops there; the turn's text, passed to :meth:`step`, includes the stop string).

    A new instance is made per episode (``rollout_env`` names the class or a factory), so episodes
    running at the same time never share state. An exception in :meth:`reset` or :meth:`step` ends that episode
    only: it is counted in ``rollout/env_errors`` and none of its tokens are trained.
    """

    turn_stop: Sequence[str] = ()

    def reset(self, prompt: Any, label: Any, metadata: dict[str, Any]) -> None | str | Awaitable[None | str]:
        """Start an episode for one prompt row (the prompt itself is already the model's context). A returned
        string is the first observation: it follows the prompt, as tokens the model is not trained on."""

    def step(self, action: str) -> Step | Awaitable[Step]:
        """React to the model's turn ``action`` (its decoded text)."""
        raise NotImplementedError(f"{type(self).__name__}.step: implement the environment's reaction to a turn")

    async def aclose(self) -> None:
        """Release what the episode holds (a connection, a session); called once when the episode ends, also
        after an error."""
