"""`inharness run` end to end on this machine: the real engine, gateway, harness subprocesses and
trainer, a few tiny steps; checkpoint, resume, Ctrl-C, and the faults a careless user or an unlucky
machine causes (SIGKILL of the run or of its children, a harness that cannot start, unwritable
outputs). Every run is started as a user types it: from a directory of its own (not the harness's),
with relative paths."""

import json
import os
import re
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
    path: Path,
    model: Path,
    *,
    steps: int,
    backend: str = "local",
    working_dir: Path = HARNESS_DIR,
    command: str = "[python, harness.py]",
    checkpoint_interval: int = 1,
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
{image}  command: {command}
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
  checkpoint: {{interval: {checkpoint_interval}, keep: 2}}
"""
    )
    return path


def command(spec: Path, out: Path, *extra: str) -> tuple[list[str], Path]:
    """`inharness run` as a user types it, and where: the spec's folder, with relative paths."""
    here = spec.parent
    argv = [sys.executable, "-m", "inharness.cli", "run", spec.name, "--out", os.path.relpath(out, here)]
    return [*argv, *extra], here


def run(spec: Path, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    argv, here = command(spec, out, *extra)
    return subprocess.run(
        argv,
        cwd=here,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def start(spec: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    argv, here = command(spec, out, *extra)
    return subprocess.Popen(
        argv,
        cwd=here,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )


def wait_for_steps(proc: subprocess.Popen[str], out: Path, steps: int, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while not ((out / "metrics.jsonl").exists() and len(steps_of(out)) >= steps):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, f"{steps} steps did not finish in time"
        time.sleep(0.1)


def attempts_in_store(out: Path) -> list[tuple[str, str | None]]:
    """(status, failure reason) of every attempt."""
    with sqlite3.connect(out / "gateway.db") as db:
        return db.execute("select status, failure_reason from attempts").fetchall()


def processes_of(out: Path) -> list[int]:
    """Live pids with a file open under `out` (the engine's and gateway's logs, a harness's stdout) or
    naming it in their environment or command line: whatever a run there left running."""
    found = []
    needle = str(out).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        proc = Path("/proc") / pid
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X") or int(pid) == os.getpid():
                continue
            named = needle in (proc / "environ").read_bytes() or needle in (proc / "cmdline").read_bytes()
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if named or any(fd.startswith(str(out)) for fd in fds):
            found.append(int(pid))
    return found


def pids_holding(path: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                found.append(int(pid))
        except OSError:
            continue
    return found


def wait_until_gone(out: Path, limit_s: float = 20) -> list[int]:
    deadline = time.monotonic() + limit_s
    while (left := processes_of(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def steps_of(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts_in_store(out: Path) -> int:
    with sqlite3.connect(out / "gateway.db") as db:
        return db.execute("select count(*) from rollouts").fetchone()[0]


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

    first_wall = metrics[-1]["wall_s"]
    assert summary["wall_seconds"] == first_wall

    resumed = run(tmp_path / "run.yaml", out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming tiny-run at step 2" in resumed.stdout
    assert steps_of(out) == [0, 1, 2]
    assert rollouts_in_store(out) == 3 * 2 * 2
    walls = [json.loads(line)["wall_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert walls[:2] == [m["wall_s"] for m in metrics] and walls[2] > first_wall, "wall time adds up"
    assert json.loads((out / "summary.json").read_text())["wall_seconds"] == walls[2]


def test_ctrl_c_stops_cleanly_and_resume_loses_no_rollout(tool_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=4)
    proc = start(spec, out)
    try:
        wait_for_steps(proc, out, 1)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "--resume" in output
    assert processes_of(out) == []
    stopped = [status for status, reason in attempts_in_store(out) if reason == "stopped"]
    assert all(status == "released" for status in stopped), "a Ctrl-C is not charged to the rollouts"

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
    assert spec.name in result.stderr and says in result.stderr, result.stderr


def test_a_harness_that_cannot_start_stops_the_run_after_its_first_batch(
    tool_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=3, command="[no-such-harness]")
    result = run(spec, out, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    err = result.stderr
    assert "batch 0: no trainable sample: 4 of 4 rollouts failed" in err, err
    assert "could not start: [Errno 2] No such file or directory: 'no-such-harness'" in err
    assert "fix: check the HarnessSpec's command" in err
    logs = re.search(r"its logs: (\S+)", err)
    assert (
        logs and Path(logs.group(1)).is_absolute() and Path(logs.group(1)).parent.parent == out / "attempts"
    )
    assert not (out / "metrics.jsonl").exists() or steps_of(out) == [], "a step with no samples is not a step"
    assert not (out / "weights" / "v1").exists(), "no version published"
    assert wait_until_gone(out) == []


def test_attempts_failing_alike_before_any_model_call_stop_the_run_early(
    tool_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    spec = write_spec(
        tmp_path / "run.yaml",
        tool_model,
        steps=3,
        command="[python, -c, 'import sys; sys.exit(\"no such module: harness_main\")']",
    )
    result = run(spec, out, "--max-consecutive-failures", "3", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "3 attempts in a row failed before any model call was recorded: exited with code 1" in result.stderr
    )
    assert "the end of its stderr:\n    no such module: harness_main" in result.stderr, result.stderr
    assert "fix: the harness failed before calling the model: read its stderr.log" in result.stderr
    failed = [a for a in attempts_in_store(out) if a[0] == "failed"]
    assert 3 <= len(failed) < 8, "stopped before burning the batch's 8 attempts"


def test_sigkill_leaves_nothing_running_and_resume_requeues_at_once_in_version_order(
    tool_model: Path, tmp_path: Path
) -> None:
    """SIGKILL of `inharness run` right after a step, while the next (sync) batch runs: its engine,
    gateway and harnesses die with it; the resume requeues the dead run's running attempts at once
    (uncharged), creates no batch twice, and serves each batch from its own version."""
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=4, checkpoint_interval=2)
    proc = start(spec, out)
    try:
        wait_for_steps(proc, out, 1)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_until_gone(out) == [], "a child of the killed run is still running"

    resumed = run(spec, out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert steps_of(out) == [0, 1, 2, 3]
    assert rollouts_in_store(out) == 4 * 2 * 2, "no batch created twice"
    attempts = attempts_in_store(out)
    assert not [a for a in attempts if a[1] == "lease expired"], "the resume waited out a lease"
    assert all(status == "released" for status, reason in attempts if reason == "its run stopped")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness_max"] for m in metrics] == [0, 0, 0, 0], "a sync batch served by another version"
    assert all(m["failed_rollouts"] == 0 for m in metrics)


@pytest.mark.parametrize("child", ["engine", "gateway"])
def test_a_killed_child_server_is_restarted_and_its_victims_are_not_charged(
    tool_model: Path, tmp_path: Path, child: str
) -> None:
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "run.yaml", tool_model, steps=3)
    proc = start(spec, out)
    try:
        wait_for_steps(proc, out, 1)
        [pid] = pids_holding(out / "logs" / f"{child}.log")
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert f"{child} was killed by SIGKILL; restarting it" in output
    assert f"{child} restarted in" in output
    assert steps_of(out) == [0, 1, 2]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["failed_rollouts"] == 0 and m["samples"] > 0 for m in metrics), metrics
    # The calc harness fails only when its model API fails: here, only while the child was down.
    assert {status for status, _ in attempts_in_store(out)} <= {"succeeded", "released"}
    assert "Traceback" not in output


def test_an_unwritable_attempts_directory_stops_the_run_without_charging_attempts(
    tool_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "attempts").write_text("a file where the attempts directory goes")
    result = run(write_spec(tmp_path / "run.yaml", tool_model, steps=2), out, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot write the attempt's files in" in result.stderr
    assert {status for status, _ in attempts_in_store(out)} == {"released"}


def test_an_unwritable_checkpoint_is_named_and_the_other_results_are_kept(
    tool_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoints go")
    result = run(write_spec(tmp_path / "run.yaml", tool_model, steps=2), out)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "could not write checkpoint step-2:" in result.stderr
    assert steps_of(out) == [0, 1]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "reward.png").read_bytes()[:4] == b"\x89PNG"


def test_a_missing_model_directory_is_named_before_anything_starts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "run.yaml", tmp_path / "no-model", steps=1)
    result = run(spec, tmp_path / "out", timeout=60)
    assert result.returncode == 2
    assert (
        f"spec.model.path: no model directory (with config.json) at {tmp_path / 'no-model'}" in result.stderr
    )
    assert "Traceback" not in result.stderr
