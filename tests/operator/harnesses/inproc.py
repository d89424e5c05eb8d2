"""Like dispatch.py, but runs the script named by the task's "run" key in this very process (runpy),
so that under spec.local.preload the behaviour runs in the forked process itself, not in an exec'd one."""

import json
import os
import runpy
import sys
from pathlib import Path

task = json.loads(os.environ["INHARNESS_TASK"])
script = str(Path(__file__).with_name(f"{task['run']}.py"))
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
