"""Servers die with the process that started them, even a SIGKILLed one, and a run directory takes one
run at a time: `inharness.procs` and `inharness.runlock` with real subprocesses (`sleep`, `http.server`)."""

import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inharness.procs import ServerProcess, die_with_parent, free_port
from inharness.runlock import RunDirBusy, RunLock

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SLEEP = ["sleep", "600"]

# A stand-in for `inharness run`: spawns one server tied to it and one plain child (a new session, as
# ServerProcess used to), prints their pids, and waits for stdin to close.
PARENT = """
import subprocess, sys
from pathlib import Path
from inharness.procs import ServerProcess
tied = ServerProcess(["sleep", "600"], port=0, log=Path(sys.argv[1]), health="/").spawn()
plain = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(tied.proc.pid, plain.pid, flush=True)
sys.stdin.read()
"""

# Holds a run directory's lock, optionally shared with a server child; `release` on stdin releases it.
HOLDER = """
import sys
from pathlib import Path
from inharness.procs import ServerProcess
from inharness.runlock import RunLock
root = Path(sys.argv[1])
lock = RunLock(root).acquire(0)
child = None
if sys.argv[2:] == ["child"]:
    child = ServerProcess(["sleep", "600"], port=0, log=root / "child.log", health="/", pass_fds=(lock.fd,))
    child.spawn()
print(child.proc.pid if child else 0, flush=True)
for line in sys.stdin:
    lock.release()
    print("released", flush=True)
"""


def until(check: Callable[[], object], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within:.0f}s: {what}")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Exited, whoever reaps it: an orphan's zombie counts as gone (its parent is init, or a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def line(proc: subprocess.Popen[str], within: float = 30.0) -> str:
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], within)[0]:
        pytest.fail(f"no output from pid {proc.pid} within {within:.0f}s")
    return proc.stdout.readline().strip()


@pytest.fixture
def cleanup() -> Iterator[list[int | subprocess.Popen[str]]]:
    """Pids and our own children to SIGKILL at the end, whatever the test got to."""
    procs: list[int | subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if isinstance(proc, subprocess.Popen):
            proc.kill()
            proc.wait(timeout=10)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc, signal.SIGKILL)


def python(script: str, *args: str, cleanup: list[int | subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    cleanup.append(proc)
    return proc


# --- die_with_parent ----------------------------------------------------------------------------------


@linux_only
def test_a_sigkilled_parent_takes_its_servers_with_it(
    tmp_path: Path, cleanup: list[int | subprocess.Popen[str]]
) -> None:
    parent = python(PARENT, str(tmp_path / "child.log"), cleanup=cleanup)
    tied, plain = map(int, line(parent).split())
    cleanup += [tied, plain]
    assert not gone(tied) and not gone(plain)

    parent.kill()
    parent.wait(timeout=10)

    until(lambda: gone(tied), "the spawned server dies with its SIGKILLed parent")
    assert not gone(plain), "a child in its own session without the parent-death signal runs on"


@linux_only
def test_a_child_whose_parent_is_already_gone_dies_at_once() -> None:
    # The race: the parent dies after the fork but before the prctl; the child has a new parent by then.
    someone_else = os.getppid()
    proc = subprocess.Popen(SLEEP, preexec_fn=functools.partial(die_with_parent, someone_else))
    assert proc.wait(timeout=10) == -signal.SIGKILL


@linux_only
def test_the_signal_follows_the_spawning_thread_so_spawn_from_the_main_one(tmp_path: Path) -> None:
    from_main = ServerProcess(SLEEP, port=0, log=tmp_path / "main.log", health="/").spawn()
    from_worker = ServerProcess(SLEEP, port=0, log=tmp_path / "worker.log", health="/")
    try:
        worker = threading.Thread(target=from_worker.spawn)
        worker.start()
        worker.join()
        assert from_worker.proc is not None
        assert from_worker.proc.wait(timeout=10) == -signal.SIGKILL  # its thread exited, so it did
        assert from_main.alive
    finally:
        from_main.stop()
        from_worker.stop()


# --- ServerProcess: alive, returncode -------------------------------------------------------------


def test_a_dead_server_is_seen_and_a_new_one_serves_its_port(tmp_path: Path) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]
    server = ServerProcess(argv, port=port, log=tmp_path / "http.log", health="/")
    assert not server.alive and server.returncode is None
    try:
        server.start(timeout=60)
        assert server.alive and server.returncode is None
        with pytest.raises(RuntimeError, match="already running"):
            server.spawn()
        first = server.proc.pid if server.proc else 0

        server.kill9()
        assert not server.alive and server.returncode == -signal.SIGKILL

        again = ServerProcess(argv, port=port, log=tmp_path / "http.log", health="/").start(timeout=60)
        assert again.alive and again.proc is not None and again.proc.pid != first
        assert again.url == server.url == f"http://127.0.0.1:{port}"
        again.stop()
        assert not again.alive
    finally:
        server.stop()


# --- RunLock -------------------------------------------------------------------------------------------


def test_a_busy_run_dir_names_its_holder_after_the_wait(
    tmp_path: Path, cleanup: list[int | subprocess.Popen[str]]
) -> None:
    holder = python(HOLDER, str(tmp_path), cleanup=cleanup)
    line(holder)

    started = time.monotonic()
    with pytest.raises(
        RunDirBusy, match=rf"{tmp_path} is in use by another inharness run \(pid {holder.pid}\)"
    ):
        RunLock(tmp_path).acquire(wait_seconds=0.3)
    assert time.monotonic() - started >= 0.3

    assert holder.stdin is not None
    holder.stdin.write("release\n")
    holder.stdin.flush()
    with RunLock(tmp_path, wait_seconds=15) as lock:
        assert lock.held and (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirBusy, match=rf"pid {os.getpid()}\)"):
            RunLock(tmp_path).acquire(0)  # another open of the file, even in this process
    assert not lock.held
    RunLock(tmp_path).acquire(0).release()
    holder.stdin.close()
    holder.wait(timeout=10)


def test_a_server_that_inherited_the_lock_keeps_the_dir_busy(
    tmp_path: Path, cleanup: list[int | subprocess.Popen[str]]
) -> None:
    holder = python(HOLDER, str(tmp_path), "child", cleanup=cleanup)
    child = int(line(holder))
    cleanup.append(child)
    assert holder.stdin is not None
    holder.stdin.write("release\n")
    holder.stdin.flush()
    assert line(holder) == "released"

    with pytest.raises(RunDirBusy, match=rf"pid {holder.pid}\)"):
        RunLock(tmp_path).acquire(0)
    os.kill(child, signal.SIGKILL)
    RunLock(tmp_path).acquire(wait_seconds=15).release()
    holder.stdin.close()
    holder.wait(timeout=10)


@pytest.mark.parametrize("with_server", [False, pytest.param(True, marks=linux_only)])
def test_a_sigkilled_run_frees_its_dir(
    tmp_path: Path, cleanup: list[int | subprocess.Popen[str]], with_server: bool
) -> None:
    """The issue's case: `inharness run` SIGKILLed, then `--resume` on the same directory. The kernel
    drops the lock with the last fd; with a server holding one, once the server has died with its parent."""
    holder = python(HOLDER, str(tmp_path), *(["child"] if with_server else []), cleanup=cleanup)
    child = int(line(holder))
    if child:
        cleanup.append(child)
    holder.kill()
    holder.wait(timeout=10)

    RunLock(tmp_path).acquire(wait_seconds=15).release()
    if child:
        until(lambda: gone(child), "the server is gone")


def test_the_message_says_when_the_holder_has_exited(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    assert "has exited, but a server it started still runs" in str(RunDirBusy(tmp_path, proc.pid))
    assert "pid unknown" in str(RunDirBusy(tmp_path, None))
