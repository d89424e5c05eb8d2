"""Child server processes (engine, gateway) on this machine: spawn, wait for health, stop, kill.

Each child gets its own process group, so stopping it also stops anything it started; waits are
bounded and a child that dies while starting is reported with its log.

A child also dies with its parent (`die_with_parent`). Its own session keeps it out of the terminal's
Ctrl-C and lets `stop` signal its whole group, but it also means nothing reaches it when the parent is
SIGKILLed or OOM-killed: without the parent-death signal it would run on with parent 1, and a resumed
run would start a second gateway on the same SQLite store.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_forking_pid: int | None = None


def _remember_forking_pid() -> None:
    # Runs in the parent just before each fork that will call back into Python in the child (os.fork,
    # and subprocess whenever preexec_fn is given), so the child knows which pid forked it. Every thread
    # of one process writes the same value, so concurrent forks do not race on it.
    global _forking_pid
    _forking_pid = os.getpid()


os.register_at_fork(before=_remember_forking_pid)


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent goes: a `preexec_fn` for
    `subprocess.Popen` and `asyncio.create_subprocess_exec`, so pass the function itself.

    `parent` is the pid that must still be the parent; by default, the process that just forked us
    (recorded before the fork). If the parent died between the fork and the prctl, the signal will
    never come (we already have a new parent), so check afterwards and die now in that case: the same
    end, SIGKILL, either way.

    The signal fires when the *thread* that forked the child exits, not the process: spawn from a
    thread that lives as long as the child (the main / event-loop thread), never from a short-lived
    worker. It survives exec (except of set-uid programs) but covers only the direct child; a
    grandchild needs its own. No-op where there is no prctl (macOS, Windows): there a SIGKILLed parent
    still leaves its children running.
    """
    if _libc is None:
        return
    expected = parent or _forking_pid or os.getppid()
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != expected:
        os.kill(os.getpid(), signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One child server: `spawn` it (from the thread that outlives it, see `die_with_parent`), then
    `wait_healthy` (anywhere, e.g. `asyncio.to_thread`); `start` does both. `alive` and `returncode`
    tell a supervisor it died (which then starts a new one on the same port).

    `pass_fds` stay open in the child, e.g. a `RunLock`'s fd: the run directory then stays locked until
    this child is gone too, not just the process that started it.
    """

    def __init__(
        self,
        argv: list[str],
        *,
        port: int,
        log: Path,
        health: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.argv, self.port, self.log, self.health = argv, port, log, health
        self.name = name or Path(argv[0]).name
        self.url = f"http://127.0.0.1:{port}"
        self.pass_fds = pass_fds
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def inharness(
        cls, args: list[str], *, port: int, log: Path, health: str, pass_fds: tuple[int, ...] = ()
    ) -> "ServerProcess":
        """`inharness ARGS...` run with this interpreter."""
        return cls(
            [sys.executable, "-m", "inharness.cli", *args],
            port=port,
            log=log,
            health=health,
            name=args[0],
            pass_fds=pass_fds,
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """None while running or before `spawn`; negative for a signal (-9: SIGKILL)."""
        return None if self.proc is None else self.proc.poll()

    def spawn(self) -> "ServerProcess":
        """Fork the child and return at once; it dies with the calling thread (`die_with_parent`), so
        call this from the main / event-loop thread, not through `asyncio.to_thread`."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                pass_fds=self.pass_fds,
                preexec_fn=die_with_parent,
            )
        return self

    def wait_healthy(self, timeout: float = 120.0) -> "ServerProcess":
        """Poll the health path until 200; blocks, so from async code run it in a thread. A child that
        exits or stays unhealthy past `timeout` is stopped and reported with its log."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not spawned")
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}; its log:\n{self._tail()}"
                    )
                try:
                    if client.get(self.url + self.health).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy within {timeout:.0f}s; its log:\n{self._tail()}")

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        """`spawn` then `wait_healthy`. Called through `asyncio.to_thread`, the child is tied to that
        executor thread and dies when the loop shuts its executor down; prefer `spawn` on the loop
        thread and `wait_healthy` in a thread."""
        return self.spawn().wait_healthy(timeout)

    def kill9(self) -> None:
        """SIGKILL the whole process group, as a crash or an OOM kill would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()

    def _tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
