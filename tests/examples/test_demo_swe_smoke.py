"""`make demo-swe`'s path in CI: the same entry point (examples/mini-swe-agent/demo.py), the same spec and
the same relative default paths, started from a repository root, with `--smoke`: the scripted teacher's
recording through the real mini-SWE-agent, `inharness sft` on it, then 2 RL steps with no script.

It runs in a copy of examples/mini-swe-agent under a temporary root (the installed harness linked in at
.cache/harnesses, where run.sh looks for it), so that it neither needs nor replaces the user's model."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESSES = REPO / ".cache" / "harnesses"


def test_the_swe_demo_records_warms_up_and_trains_through_mini_swe_agent(tmp_path: Path) -> None:
    if not (HARNESSES / "mini-swe-agent" / "bin" / "mini").exists():
        pytest.skip("mini-SWE-agent is not installed: run `make harnesses`")
    root = tmp_path / "clone"
    shutil.copytree(
        REPO / "examples" / "mini-swe-agent",
        root / "examples" / "mini-swe-agent",
        ignore=shutil.ignore_patterns("model", "__pycache__", "runs"),
    )
    (root / ".cache").mkdir()
    (root / ".cache" / "harnesses").symlink_to(HARNESSES)
    result = subprocess.run(
        [sys.executable, "examples/mini-swe-agent/demo.py", "--smoke"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "smoke: every step trained, no rollout failed" in output

    demo = root / "runs" / "mini-swe-agent-demo"
    recorded = [json.loads(x) for x in (demo / "teacher" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["failed_rollouts"] == 0 and m["calls"] == 3 * m["rollouts"] for m in recorded)
    warmed = json.loads((root / "examples" / "mini-swe-agent" / "model" / "sft_summary.json").read_text())
    assert warmed["rollouts_kept"] == sum(m["rollouts"] for m in recorded) and warmed["skipped"] == {}
    assert warmed["loss_last"] < warmed["loss_first"]

    rl = demo / "rl"
    metrics = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["samples"] > 0 and m["failed_rollouts"] == 0 for m in metrics)
    assert (rl / "reward.png").read_bytes()[:4] == b"\x89PNG"
    for attempt in (rl / "attempts").iterdir():
        graded = json.loads((attempt / "result.json").read_text())
        assert graded["reward"] in (0.0, 1.0) and (attempt / "traj.json").exists()
    facts = json.loads((demo / "demo.json").read_text())
    assert facts["protocol"].startswith("openai.chat") and facts["model_calls_per_rollout"] >= 1

    # The premise's measurement (premise.py) on this short warm-up: it finds each task's answering prompt
    # in the recording and counts what the samples do (the rates themselves need the full warm-up).
    sys.path.insert(0, str(root / "examples" / "mini-swe-agent"))
    try:
        import premise
    finally:
        sys.path.pop(0)
    measured = premise.measure(demo / "teacher", root / "examples" / "mini-swe-agent" / "model", samples=2)
    assert measured["samples"] == 2 * len(premise.family.OPPOSITES)
    assert measured["right"] <= measured["well_formed"] <= measured["samples"]
    assert measured["named"] <= measured["well_formed"]
