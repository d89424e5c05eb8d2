"""A module to preload: each import appends a line (its pid) to the file named by PRELOAD_MARKER_FILE."""

import os

with open(os.environ["PRELOAD_MARKER_FILE"], "a") as marks:
    marks.write(f"{os.getpid()}\n")
