"""Keeps the child servers of `inharness run` (engine, gateway) alive, and remembers when they were not.

A child that dies (an OOM kill, a crash, a careless `kill`) is restarted on its port, at most
`max_restarts` times per child; while it is down, harnesses fail through no fault of their own.
`outage_since` tells the rollout controller so, and it releases such attempts instead of charging
them to their rollouts. A child that cannot be restarted ends the run with one line that names it
and its log (`fatal`).
"""

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from inharness.procs import ServerProcess

Say = Callable[[str], None]


@dataclass
class _Outage:
    what: str
    started: float  # time.time()
    ended: float | None = None


@dataclass
class _Child:
    proc: ServerProcess
    respawn: Callable[[], ServerProcess]  # a fresh process for the same role and port
    restarts: int = 0
    down: _Outage | None = None


class Supervisor:
    poll_seconds = 0.25
    start_timeout_seconds = 120.0

    def __init__(self, say: Say, *, max_restarts: int = 3) -> None:
        self.say = say
        self.max_restarts = max_restarts
        self.fatal: str | None = None
        self.halted = asyncio.Event()  # set with `fatal`
        self.outages: list[_Outage] = []
        self._children: dict[str, _Child] = {}

    def add(self, name: str, proc: ServerProcess, respawn: Callable[[], ServerProcess]) -> None:
        self._children[name] = _Child(proc, respawn)

    def stop_all(self) -> None:
        """Stop the children, the last added first (the gateway before the engine it calls)."""
        for child in reversed(self._children.values()):
            child.proc.stop()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop` (or a child that cannot be restarted): notice deaths, restart."""
        while not stop.is_set() and self.fatal is None:
            self._notice()
            for name, child in self._children.items():
                if child.down is not None and child.down.ended is None:
                    await self._restart(name, child)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_seconds)

    async def outage_since(self, started_at: float) -> str | None:
        """What was down at some time since `started_at` (time.time()), or None."""
        self._notice()
        for outage in self.outages:
            if outage.ended is None or outage.ended >= started_at:
                return outage.what
        return None

    def _notice(self) -> None:
        now = time.time()
        for name, child in self._children.items():
            up = child.down is None or child.down.ended is not None
            if up and not child.proc.alive:
                child.down = _Outage(f"{name} {_how(child.proc.returncode)}", now)
                self.outages.append(child.down)

    async def _restart(self, name: str, child: _Child) -> None:
        assert child.down is not None
        log = child.proc.log
        if child.restarts >= self.max_restarts:
            self._halt(f"{child.down.what} after {child.restarts} restarts; giving up (log: {log})")
            return
        child.restarts += 1
        self.say(f"inharness run: {child.down.what}; restarting it (log: {log})")
        began = time.monotonic()
        proc = child.respawn()
        try:
            proc.spawn()  # from this (the event loop's) thread: the child dies with it
            await asyncio.to_thread(proc.wait_healthy, self.start_timeout_seconds)
        except (OSError, RuntimeError) as exc:
            proc.stop()
            self._halt(f"{child.down.what} and could not be restarted: {exc}")
            return
        child.proc = proc
        child.down.ended = time.time()
        self.say(f"inharness run: {name} restarted in {time.monotonic() - began:.1f}s")

    def _halt(self, why: str) -> None:
        if self.fatal is None:
            self.fatal = why
            self.halted.set()


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
