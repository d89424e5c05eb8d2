"""Child server processes (engine, gateway) on this machine: start, wait for health, stop, kill.

Each child gets its own process group, so stopping it also stops anything it started; waits are
bounded and a child that dies while starting is reported with its log.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        argv: list[str],
        *,
        port: int,
        log: Path,
        health: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        self.argv, self.port, self.log, self.health = argv, port, log, health
        self.name = name or Path(argv[0]).name
        self.url = f"http://127.0.0.1:{port}"
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def inharness(cls, args: list[str], *, port: int, log: Path, health: str) -> "ServerProcess":
        """`inharness ARGS...` run with this interpreter."""
        return cls(
            [sys.executable, "-m", "inharness.cli", *args], port=port, log=log, health=health, name=args[0]
        )

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )
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
