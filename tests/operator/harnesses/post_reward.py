"""A harness that posts its reward to the gateway ($OPENAI_BASE_URL/inharness/reward, with its key)
instead of, or besides, writing a result file; then exits with the task's code."""

import json
import os
import sys
import urllib.request
from pathlib import Path

task = json.loads(os.environ["INHARNESS_TASK"])
for reward in task.get("post", []):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/inharness/reward",
        data=json.dumps({"reward": reward, "note": "posted"}).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200, answer.read()
if "write" in task:
    Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps(task["write"]))
sys.exit(task.get("exit", 0))
