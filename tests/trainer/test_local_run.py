"""`inharness run` end to end on this machine: the real engine, gateway, harness subprocesses and
trainer, a few tiny steps; checkpoint, resume, and Ctrl-C."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS_DIR = REPO / "examples" / "calc"


def write_spec(
    path: Path, model: Path, *, steps: int, backend: str = "local", working_dir: Path = HARNESS_DIR
) -> Path:
    """A spec file for the calc harness; with backend kubernetes (and an image), as the operator
    takes it, which `inharness run` runs as local processes all the same."""
    tasks = [{"question": "What is 2+3?", "answer": "5"}, {"question": "What is 4+1?", "answer": "5"}]
    image = "  image: example.org/calc-harness:test\n" if backend == "kubernetes" else ""
    path.write_text(
        f"""
apiVersion: inharness.dev/v1alpha1
kind: HarnessSpec
metadata: {{name: calc}}
spec:
{image}  command: [python, harness.py]
  workingDir: {working_dir}
  timeoutSeconds: 60
---
apiVersion: inharness.dev/v1alpha1
kind: RolloutPool
metadata: {{name: pool}}
spec: {{harnessRef: {{name: calc}}, parallelism: 2, maxAttemptsPerRollout: 2, backend: {backend}}}
---
apiVersion: inharness.dev/v1alpha1
kind: TrainingRun
metadata: {{name: tiny-run}}
spec:
  model: {{path: {model}}}
  dataset: {{tasks: {json.dumps(tasks)}}}
  rolloutPoolRef: {{name: pool}}
  algorithm: {{groupSize: 2, learningRate: 1.0e-4}}
  batchSize: 2
  steps: {steps}
  checkpoint: {{interval: 1, keep: 2}}
"""
    )
    return path


def run(spec: Path, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inharness.cli", "run", str(spec), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def steps_of(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts_in_store(out: Path) -> int:
    with sqlite3.connect(out / "gateway.db") as db:
        return db.execute("select count(*) from rollouts").fetchone()[0]


def processes_using(path: Path) -> list[int]:
    """Pids whose environment mentions `path` (harnesses get their result file under it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(path).encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_run_takes_a_kubernetes_pool_and_says_it_runs_it_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loading side of `inharness run`, without training: the example file (its pool has
    backend kubernetes, for the operator) is accepted, with one line saying how it runs here."""
    from inharness import run as local_run

    started: list[tuple[Path, Path]] = []

    async def train(file: Path, out: Path, **_: object) -> int:
        started.append((file, out))
        return 0

    monkeypatch.setattr(local_run, "_train", train)
    example = HARNESS_DIR / "trainingrun.yaml"
    assert local_run.run_file(example, tmp_path / "out") == 0
    assert started == [(example, tmp_path / "out")]
    assert capsys.readouterr().out == (
        'RolloutPool "calc-pool": backend kubernetes runs as local processes under inharness run '
        "(image ghcr.io/inharness/calc-harness:0.1.0 ignored)\n"
    )

    local = write_spec(tmp_path / "local.yaml", tmp_path / "model", steps=1)
    assert local_run.run_file(local, tmp_path / "out") == 0
    assert capsys.readouterr().out == ""  # backend local: nothing to say


def test_run_checks_a_kubernetes_pool_as_it_runs_it_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What running the harness here needs is checked whatever the backend (the workingDir exists);
    what the operator needs (an image) is required for backend kubernetes even here."""
    from inharness import run as local_run

    async def train(file: Path, out: Path, **_: object) -> int:
        raise AssertionError("a refused spec must not start a run")

    monkeypatch.setattr(local_run, "_train", train)
    spec = write_spec(
        tmp_path / "run.yaml", tmp_path / "model", steps=1, backend="kubernetes", working_dir=tmp_path / "no"
    )
    assert local_run.run_file(spec, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f'spec.workingDir: not a directory: {tmp_path / "no"} (RolloutPool "pool" runs it locally)' in err

    spec.write_text(spec.read_text().replace("  image: example.org/calc-harness:test\n", ""))
    assert local_run.run_file(spec, tmp_path / "out") == 2
    assert (
        'spec.image: required, as RolloutPool "pool" runs it with backend kubernetes'
        in capsys.readouterr().err
    )


KUBERNETES_NOTE = (
    'RolloutPool "pool": backend kubernetes runs as local processes under inharness run '
    "(image example.org/calc-harness:test ignored)"
)


def test_run_writes_metrics_and_checkpoints_then_resumes_without_duplicates(
    tool_model: Path, tmp_path: Path
) -> None:
    # Backend kubernetes, as the operator takes the file: here its harness runs as local processes.
    out = tmp_path / "out"
    first = run(write_spec(tmp_path / "run.yaml", tool_model, steps=2, backend="kubernetes"), out)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.splitlines()[0] == KUBERNETES_NOTE
    attempts = list((out / "attempts").iterdir())  # one local harness process per attempt, no pods
    assert len(attempts) >= 8 and all((a / "stdout.log").is_file() for a in attempts)
    assert steps_of(out) == [0, 1]
    assert (out / "reward.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollouts"] == 8
    assert (out / "checkpoints" / "step-2" / "state.json").exists()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["logprob_mismatch"] < 1e-3 for m in metrics)  # the trainer scores what the engine sampled
    assert all(m["prefix_mismatches"] == 0 and m["failed_rollouts"] == 0 for m in metrics)

    again = run(write_spec(tmp_path / "run.yaml", tool_model, steps=3, backend="kubernetes"), out)
    assert again.returncode == 2 and "--resume" in again.stderr

    resumed = run(tmp_path / "run.yaml", out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming tiny-run at step 2" in resumed.stdout
    assert steps_of(out) == [0, 1, 2]
    assert rollouts_in_store(out) == 3 * 2 * 2


def test_ctrl_c_stops_cleanly_and_resume_loses_no_rollout(tool_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=4)
    proc = subprocess.Popen(
        [sys.executable, "-m", "inharness.cli", "run", str(spec), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").exists() and steps_of(out)):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no step finished in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "--resume" in output
    assert processes_using(out) == []

    resumed = run(spec, out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert steps_of(out) == [0, 1, 2, 3]
    assert rollouts_in_store(out) == 4 * 2 * 2  # every batch created once, whatever was in flight at Ctrl-C


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda t: t.replace("groupSize: 2", "groupSize: 1"), "spec.algorithm.groupSize"),
        (lambda t: t.replace("rolloutPoolRef: {name: pool}", "rolloutPoolRef: {name: nope}"), "nope"),
        (lambda t: t.replace("kind: TrainingRun", "kind: TrainingRn"), "TrainingRn"),
    ],
)
def test_bad_spec_is_refused_with_file_document_and_field(
    tool_model: Path, tmp_path: Path, edit: object, says: str
) -> None:
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=1)
    spec.write_text(edit(spec.read_text()))  # type: ignore[operator]
    result = run(spec, tmp_path / "out", timeout=60)
    assert result.returncode == 2
    assert str(spec) in result.stderr and says in result.stderr, result.stderr
