"""Reward for the calculator example: did the final answer state the expected number?"""

from __future__ import annotations

import re
from typing import Any

# A number not glued to other digits, a decimal point, a thousands comma or a letter: "22" counts in
# "The answer is 22." but not in "122", "2.22", "1,022" or "x22".
_NUMBER = re.compile(r"(?<![\w.])(?<!\d,)-?\d+(?:\.\d+)?(?!\w|\.\d|,\d)")


def numbers(text: str) -> list[float]:
    """The standalone numbers in `text`, in order."""
    return [float(m) for m in _NUMBER.findall(text)]


def grade(task: dict[str, Any], final_answer: str | None) -> float:
    """1.0 when the last standalone number of `final_answer` is the task's expected answer, else 0.0.

    The last number, as GSM8K-style graders read it, so "7+5 = 12" counts but babble that echoes the
    question's numbers before or after other numbers does not (during RL a policy that drifts into
    babble would otherwise collect reward by chance). Numeric comparison, so "22.0" matches "22"; a
    missing answer (the agent never stopped calling tools) scores 0.
    """
    found = numbers(final_answer or "")
    return 1.0 if found and abs(found[-1] - float(task["answer"])) < 1e-9 else 0.0
