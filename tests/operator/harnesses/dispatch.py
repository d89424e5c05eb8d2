"""Test harness entry point: one HarnessSpec, several behaviours in one batch. Runs (exec, same
process) the script named by the task's "run" key, so that each behaviour stays its own plain script."""

import json
import os
import sys
from pathlib import Path

task = json.loads(os.environ["INHARNESS_TASK"])
script = Path(__file__).with_name(f"{task['run']}.py")
os.execv(sys.executable, [sys.executable, str(script)])
