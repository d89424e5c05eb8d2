"""The fuzz tier against what users run: Schemathesis' own command line on the served `/openapi.json`,
in front of a real `inharness engine` with the tiny model (tools/fuzz.py, which `make fuzz` runs for as
long as asked with a fresh seed). Here bounded to about a minute: the coverage phase (the schema's
boundary values, where an outside fuzzer found top_p 5e-324 and a 23-digit export cursor) on every
harness and control route, and the stateful phase (calls linked by the ids they return) on the control
routes, with a fixed seed so that a failure is a regression to replay with `make fuzz SEED=0`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 50


def test_coverage_and_stateful_phases_find_no_5xx_and_no_broken_response() -> None:
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        pytest.skip(f"Schemathesis' command line is not installed ({st}); make installs it")
    cmd = [sys.executable, str(ROOT / "tools" / "fuzz.py"), "--seconds", str(SECONDS), "--seed", "0"]
    result = subprocess.run(
        [*cmd, "--phases", "coverage,stateful"], capture_output=True, text=True, timeout=SECONDS + 120
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    # Both targets ran to their end: st's last line says no issues, or only warnings (what the schema
    # allows and a handler refuses); a failure or error would be counted there and fail the exit code.
    ends = re.findall(r"=+ (No issues found|\d+ warnings?) in [\d.]+s =+", out)
    assert len(ends) == 2, out[-6000:]
    assert "✅ Coverage" in out and "✅ Stateful" in out, out[-6000:]
    assert "fuzz seed 0: no failures" in out
