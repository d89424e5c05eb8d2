"""What every part of the store shares: its errors, the records it passes, and the write transaction.

`StoreCore` names the state that `Store.__init__` sets (store.py) and that each concern's methods use
(queue.py, calls.py, serving.py); it holds no query of its own.
"""

import asyncio
import hashlib
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import (
    Engine,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

# full: every call's request and response body as the harness sent and got it; none: JSON null, for a
# run that needs only what training reads (token ids, log-probs, the call tree).
Bodies = Literal["full", "none"]


class StoreError(Exception):
    """Base of the store's refusals; the message is shown to the API client."""


class AttemptEnded(StoreError):
    """A call's attempt was no longer running with a live lease when its record was to be committed:
    the call is not recorded (docs/gateway.md, What is recorded)."""


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


@dataclass(frozen=True, slots=True)
class AttemptAuth:
    """What the harness-facing API needs to know about the attempt behind an API key."""

    id: str
    rollout_id: str
    status: str  # running | succeeded | failed | released | expired
    lease_expires_at: float


@dataclass(slots=True)
class CallRecord:
    """The internal record of one model call choice, whatever protocol the harness spoke."""

    attempt_id: str
    rollout_id: str
    request_id: str
    choice_index: int
    protocol: str
    requested_model: str
    model_version: int
    engine: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    response_logprobs: Sequence[float]
    finish_reason: str
    parent_call_id: int | None
    prefix_reused: bool
    prefix_mismatch: str | None
    request_digest: str
    reply_digest: str
    started_at: float
    first_token_at: float | None
    finished_at: float
    request_body: dict[str, Any]
    response_body: dict[str, Any]
    notes: Sequence[str] = ()  # what of the request the prompt leaves out, and why
    turns_digest: str | None = None  # reply digest of the turns chain (no system messages, no tools)
    id: int | None = None


@dataclass(frozen=True, slots=True)
class SharedServing:
    """The serving pause as the store holds it; `generation` counts its changes."""

    paused: bool
    resumes_at: float | None
    generation: int

    def holding(self, now: float) -> bool:
        """Paused and its hold timeout not yet passed."""
        return self.paused and (self.resumes_at is None or now < self.resumes_at)


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One gateway process as it last reported itself: the serving generation it has applied, its calls."""

    id: str
    host: str
    pid: int
    seen_at: float
    generation: int
    in_flight: int
    held: int


@dataclass(frozen=True, slots=True)
class ParentCall:
    """An earlier call that a new turn can extend: its token ids and how it ended."""

    id: int
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


class StoreCore:
    """The state of one open store, shared by its concerns' methods (set by `Store.__init__`)."""

    _engine: AsyncEngine
    _bodies: Bodies
    _call_engine: Engine | None
    _call_thread: ThreadPoolExecutor | None
    _write_lock: asyncio.Lock | None
    _call_queue: asyncio.Queue[tuple[list[CallRecord], asyncio.Future[None]]]
    _writer: asyncio.Task[None] | None

    def _writing(self) -> "_WriteTxn":
        return _WriteTxn(self)


class _WriteTxn:
    """`async with store._writing() as conn`: one write transaction, serialised on SQLite."""

    def __init__(self, store: StoreCore) -> None:
        self._store = store
        self._ctx: Any = None

    async def __aenter__(self) -> AsyncConnection:
        if self._store._write_lock is not None:
            await self._store._write_lock.acquire()
        try:
            self._ctx = self._store._engine.begin()
            return await self._ctx.__aenter__()
        except BaseException:
            if self._store._write_lock is not None:
                self._store._write_lock.release()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._ctx.__aexit__(*exc)
        finally:
            if self._store._write_lock is not None:
                self._store._write_lock.release()
