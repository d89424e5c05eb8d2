"""The grader of the mini-SWE-agent example: the reward is read from the workspace, not from the agent.

    python3 grade.py WORKSPACE      (the task JSON in $INHARNESS_TASK)

1.0 when the task's file holds exactly its content (one trailing newline allowed, as `echo` writes it),
else 0.0: a missing file, a different word, several words, a directory in its place. Prints the result
JSON (`{"reward": ..., "found": ...}`) on stdout; run.sh writes it to the attempt's result file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

MAX_READ = 4096  # an agent may have written a huge file: what it holds past this cannot be the answer


def grade(task: dict[str, Any], workspace: Path) -> dict[str, Any]:
    path = workspace / task["file"]
    try:
        with path.open("rb") as f:
            found = f.read(MAX_READ).decode("utf-8", errors="replace")
    except OSError:
        return {"reward": 0.0, "found": None}
    text = found[:-1] if found.endswith("\n") else found
    return {"reward": 1.0 if text == task["content"] else 0.0, "found": found[:200]}


if __name__ == "__main__":
    print(json.dumps(grade(json.loads(os.environ["INHARNESS_TASK"]), Path(sys.argv[1]))))
