"""A harness that exits 0 but leaves a bad result: garbage, a result without a reward, or none."""

import json
import os
from pathlib import Path

task = json.loads(os.environ["INHARNESS_TASK"])
result = Path(os.environ["INHARNESS_RESULT_FILE"])
if task["write"] == "garbage":
    result.write_text('{"reward": 1.0,')
elif task["write"] == "no_reward":
    result.write_text(json.dumps({"score": 1.0}))
