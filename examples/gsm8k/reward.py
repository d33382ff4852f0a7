"""GSM8K reward for the CPU example: exact answer, plus a format reward a tiny model can earn.

The prompt ends with ``answer: ####`` (see the README's ``raygym data prepare`` command), so the
response should be just the final number. ``raygym.rewards.scoring.gsm8k_reward`` checks the number; a
response that is a number and nothing else earns 0.5 even when it is wrong, so a model that cannot
solve the problems yet still gets a signal for the format. Use ``--rm-type gsm8k`` instead with a
model that can do the maths.
"""

from __future__ import annotations

import re
from typing import Any

from raygym.rewards.scoring import gsm8k_reward

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(response: str, label: Any) -> float:
    """1.0 for the right answer; 0.5 for a bare number; 0.25 for text that starts with a number.

    >>> score("72", "72"), score(" 70", "72"), score("70 apples", "72"), score("apples", "72")
    (1.0, 0.5, 0.25, 0.0)
    """
    text = response.strip()
    if gsm8k_reward("#### " + text, label) == 1.0 and _NUMBER.fullmatch(text):
        return 1.0
    if _NUMBER.fullmatch(text):
        return 0.5
    return 0.25 if _NUMBER.match(text) else 0.0
