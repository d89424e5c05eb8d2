"""`make demo`'s path in CI: the same entry point (examples/calc/demo.py), the same spec and the same
relative default paths, started from a repository root, with `--smoke` (a short warm-up, 2 steps).

It runs in a copy of examples/calc under a temporary root, so that it neither needs nor replaces the
user's warmed-up model and demo output, and so that the run starts where the harness does not live:
`runs/calc-demo` is relative to the root, the harness runs in examples/calc."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("engine", "out_dir"), [("torch", "calc-demo"), ("verl", "calc-demo-verl")], ids=["torch", "verl"]
)
def test_the_demo_trains_from_a_repository_root_with_its_relative_defaults(
    tmp_path: Path, engine: str, out_dir: str
) -> None:
    """The verl case is `make demo-verl`'s path: `inharness run` with spec.trainer.engine verl, its
    FSDP workers on a local Ray (about three minutes here)."""
    root = tmp_path / "clone"
    shutil.copytree(
        REPO / "examples" / "calc",
        root / "examples" / "calc",
        ignore=shutil.ignore_patterns("model", "__pycache__"),
    )
    result = subprocess.run(
        [sys.executable, "examples/calc/demo.py", "--smoke", "--engine", engine],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "smoke: every step trained, no rollout failed" in output

    out = root / "runs" / out_dir / "rollout-level"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["samples"] > 0 and m["failed_rollouts"] == 0 for m in metrics)
    assert (out / "reward.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_rollouts"] == 0 and summary["samples"] > 0
    attempts = list((out / "attempts").iterdir())
    results = [a / "result.json" for a in attempts if (a / "result.json").exists()]
    assert len(results) == summary["rollouts"], "each harness wrote its result where its runner reads it"
    assert not list((root / "examples" / "calc").glob("runs")), "nothing lands in the harness's directory"
