"""A harness for grader and exit-code modes: prints the task's answer, leaves a note in its result
file, and exits with the task's exit code."""

import json
import os
import sys
from pathlib import Path

task = json.loads(os.environ["INHARNESS_TASK"])
print(task.get("answer", ""))
if "INHARNESS_RESULT_FILE" in os.environ:
    Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps({"note": "from the harness"}))
sys.exit(task.get("exit", 0))
