"""Pause and resume of harness-facing serving around a weight update.

While paused, new harness calls wait inside the gateway (they are not refused); calls already
running finish. A pause ends with `resume` or, so that a crashed trainer cannot stall every
harness, by itself after its hold timeout.

The gate is one process's; with several gateway processes on one store the pause lives in the store
(`Store.set_serving`), the route that changes it applies it here at once, and every other process
applies it within its poll (`apply`, from app.py), its timer set to the same wall-clock `resumes_at`.
"""

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from inharness.gateway.schema import ServingState
from inharness.gateway.store.base import WorkerReport

# How often each process reports itself and applies the store's serving state and model versions.
POLL_SECONDS = 0.15
# A process not heard from for this long is gone: a pause no longer waits for it.
LIVE_SECONDS = 3.0


class ServingGate:
    def __init__(self, *, default_hold_seconds: float) -> None:
        self._default_hold = default_hold_seconds
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._resume_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.in_flight = 0
        self.held = 0
        self.generation = 0  # the store's serving generation last applied here

    @property
    def holding(self) -> bool:
        """Whether a call admitted now waits (a pause is on)."""
        return not self._open.is_set()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if not self._open.is_set():
            self.held += 1
            try:
                await self._open.wait()
            finally:
                self.held -= 1
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def hold_seconds(self, requested: float | None) -> float:
        return requested or self._default_hold

    def hold_until(self, resumes_at: float) -> None:
        """Hold new calls until `resume` or the wall-clock time `resumes_at`."""
        self._open.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._resume_at = resumes_at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, resumes_at - time.time()), self.resume)

    async def drain(self, seconds: float) -> None:
        """Wait up to `seconds` for the calls admitted here to finish."""
        if seconds > 0 and self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), seconds)

    def apply(self, *, holding: bool, resumes_at: float | None, generation: int) -> None:
        """Take on the store's serving state (another process paused or resumed). A pause whose time
        has passed is over, as it is where its timer ran, though the store still says paused."""
        if holding and resumes_at is not None and resumes_at > time.time():
            if self._resume_at != resumes_at:
                self.hold_until(resumes_at)
        elif not self._open.is_set():
            self.resume()
        self.generation = generation

    def resume(self) -> ServingState:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._resume_at = None
        self._open.set()
        return self.state()

    def state(self) -> ServingState:
        return ServingState(
            paused=not self._open.is_set(),
            in_flight=self.in_flight,
            held=self.held,
            resumes_at=self._resume_at,
        )


def worker_report(gate: ServingGate, worker_id: str) -> WorkerReport:
    """This process as the store's `gateway_workers` row shows it to the others."""
    return WorkerReport(
        worker_id, socket.gethostname(), os.getpid(), time.time(), gate.generation, gate.in_flight, gate.held
    )
