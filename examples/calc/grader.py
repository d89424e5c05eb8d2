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
    """1.0 when `final_answer` contains the task's expected answer as a standalone number, else 0.0.

    Numeric comparison, so "22.0" matches "22"; a missing answer (the agent never stopped calling tools)
    scores 0.
    """
    if not final_answer:
        return 0.0
    expected = float(task["answer"])
    return 1.0 if any(abs(n - expected) < 1e-9 for n in numbers(final_answer)) else 0.0
