"""A harness that dies: a message on stderr, exit code 3, no result."""

import sys

print("boom: the harness fell over", file=sys.stderr)
sys.exit(3)
