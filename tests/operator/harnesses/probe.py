"""Reports what the harness sees of its own process in its result: argv, cwd, environment,
__name__, __file__, sys.path[0], its process group and session, its parent, and whether
preload_marker was imported before this script imported it."""

import json
import os
import sys
from pathlib import Path

preloaded = "preload_marker" in sys.modules
import preload_marker  # noqa: E402, F401

seen = {
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "ppid": os.getppid(),
    "preloaded": preloaded,
}
Path(os.environ["INHARNESS_RESULT_FILE"]).write_text(json.dumps({"reward": 1.0, "seen": seen}))
