"""The code example's reward: the fraction of the (graded) tests that the completed ``f=lambda x:...``
passes in raygym's sandbox (two sandbox actors, 2 CPU-seconds and 5 s per run). Code that does not
compile, raises, loops or exhausts a limit passes nothing."""

from __future__ import annotations

from raygym.sandbox.isolation import Limits
from raygym.sandbox.reward import CodeReward

score = CodeReward(prefix="f=lambda x:", pool_size=2, limits=Limits(cpu_seconds=2, wall_seconds=5.0))
