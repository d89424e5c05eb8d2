"""A harness that never finishes and ignores SIGTERM, with a child (same process group) that does the
same: only SIGKILL to the whole group ends them. Writes both pids for the test to check."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(
    [
        sys.executable,
        "-c",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.1)",
    ]
)
pids = {"pid": os.getpid(), "child": child.pid}
Path(os.environ["TEST_PID_DIR"], os.environ["INHARNESS_ATTEMPT_ID"] + ".json").write_text(json.dumps(pids))
while True:
    time.sleep(0.1)
