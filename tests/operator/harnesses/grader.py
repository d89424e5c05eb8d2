"""A grader: reward 1.0 when the harness printed the expected answer and exited 0, else 0.0."""

import json
import os
import sys
from pathlib import Path

task = json.loads(Path(os.environ["INHARNESS_TASK_FILE"]).read_text())
if task.get("grader_crash"):
    print("grader: cannot grade this", file=sys.stderr)
    sys.exit(1)
output = Path(os.environ["INHARNESS_OUTPUT_FILE"]).read_text().strip()
exit_code = int(os.environ["INHARNESS_EXIT_CODE"])
harness_result = os.environ.get("INHARNESS_HARNESS_RESULT_FILE")
note = json.loads(Path(harness_result).read_text())["note"] if harness_result else None
reward = 1.0 if output == task["expected"] and exit_code == 0 else 0.0
result = {"reward": reward, "exit_code_seen": exit_code, "harness_note": note}
Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps(result))
