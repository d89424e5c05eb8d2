"""Pause and resume of harness-facing serving around a weight update.

While paused, new harness calls wait inside the gateway (they are not refused); calls already
running finish. A pause ends with `resume` or, so that a crashed trainer cannot stall every
harness, by itself after its hold timeout.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from inharness.gateway.schema import ServingState


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

    async def pause(self, *, hold_seconds: float | None, drain_seconds: float) -> ServingState:
        hold = hold_seconds or self._default_hold
        self._open.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._resume_at = time.time() + hold
        self._timer = asyncio.get_running_loop().call_later(hold, self.resume)
        if drain_seconds > 0 and self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_seconds)
        return self.state()

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
