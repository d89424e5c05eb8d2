"""Rollout controllers: claim queued attempts of one pool from the gateway, run one harness per
attempt, and report each outcome.

The claim loop, leases and reporting are the same whatever runs the harness, so they live here in
`ClaimingController`; a backend (local processes, Kubernetes pods) only says how to run one attempt
to an `Outcome`. Callers depend on `RolloutBackend` alone.

Three ways an attempt ends: `succeeded`, `failed` (the harness's fault: it counts against the
rollout's `maxAttemptsPerRollout`) and `released` (not the harness's fault: the controller was
stopped, or the machine's engine or gateway was down; the rollout is requeued uncharged).
"""

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt

_log = logging.getLogger(__name__)

REWARD_MISSING = "_reward_missing"
"""Info key of an `Outcome.missing_reward`; never reported, `with_posted_reward` removes it."""


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as reported to the gateway; a failure's `info["reason"]` says why in
    words a user can act on."""

    status: Literal["succeeded", "failed", "released"]
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def success(cls, reward: float, **info: Any) -> "Outcome":
        return cls("succeeded", reward, info)

    @classmethod
    def failure(cls, reason: str, **info: Any) -> "Outcome":
        return cls("failed", None, {"reason": reason, **info})

    @classmethod
    def missing_reward(cls, reason: str, **info: Any) -> "Outcome":
        """A harness that ended normally without a reward in its result: a failure with `reason`,
        unless the harness posted a reward to the gateway (`ClaimingController.with_posted_reward`)."""
        return cls("failed", None, {"reason": reason, **info, REWARD_MISSING: True})

    @classmethod
    def released(cls, reason: str, **info: Any) -> "Outcome":
        """Not the harness's fault (a stop, an outage of the infrastructure): requeued uncharged."""
        return cls("released", None, {"reason": reason, **info})

    @property
    def reason(self) -> str | None:
        return self.info.get("reason")


class RunnerFault(Exception):
    """The runner itself cannot run attempts (it cannot write its own files, say): the attempt is
    released and the controller stops with this message, rather than burning every attempt."""


Outage = Callable[[float], Awaitable[str | None]]
"""Why a failure of an attempt that started at this time (time.time()) is the infrastructure's
fault, e.g. "engine was killed by SIGKILL"; None when nothing was down."""


# What a user can do about a failure, by how its reason starts; shown when a run stops early.
FIXES = {
    "could not start": "check the HarnessSpec's command (on PATH, or relative to workingDir) and workingDir",
    "exited with code": "the harness failed before calling the model: read its stderr.log",
    "killed by signal": "the harness was killed before calling the model: read its stderr.log",
    "timed out after": "the harness made no model call within timeoutSeconds: does it read the model "
    "endpoint from the environment variables the HarnessSpec's model section names?",
    "result file missing": 'the harness must write {"reward": ...} to the file its outcome\'s '
    "resultFileEnv names, or post its reward to the gateway",
}


def fix_for(reason: str) -> str | None:
    """What a user can do about a failure with this reason, where it is known."""
    return next((fix for start, fix in FIXES.items() if reason.startswith(start)), None)


OnFinish = Callable[[ClaimedAttempt, Outcome], None]


class RolloutBackend(Protocol):
    """What the trainer and the CLI see of a rollout controller: run until stopped, and counters
    for progress display."""

    started: int
    succeeded: int
    failed: int
    released: int
    failed_by_reason: Counter[str]
    fatal: str | None

    @property
    def running(self) -> int: ...

    async def run(self, stop: asyncio.Event) -> None: ...


class Abort:
    """Why a running attempt must end early (stop, lost lease); the first reason wins."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""

    def trigger(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def reason_key(reason: str) -> str:
    """Counter key of a failure reason: its part before any ':' detail, so that keys stay few."""
    return reason.split(":", 1)[0].strip()


class ClaimingController(ABC):
    """Keeps up to `parallelism` attempts of `pool_name` running: claims while below it, polls with
    a bounded backoff while the queue is empty, heartbeats each attempt's lease, and reports its
    outcome. On `stop`, claiming ends, running attempts are aborted and released (reason "stopped",
    not charged to their rollouts) and `run` returns once every one of them has been reported.

    It also stops by itself, with `fatal` saying why, when rollouts cannot work: after
    `max_consecutive_failures` attempts in a row failed the same way (`reason_key`) before any model
    call was recorded (a missing harness command, a harness that crashes at import), or at a
    `RunnerFault`. `outage`, when given, turns a failure during an infrastructure outage into a
    release."""

    idle_min_seconds = 0.05
    idle_max_seconds = 0.5
    report_tries = 3
    # Gateway calls in flight at most (None: no limit). A backend with thousands of attempts sets it:
    # httpx's connection pool does work in proportion to its waiting requests on every change, so
    # thousands of heartbeats at once would cost O(n^2) there.
    gateway_concurrency: int | None = None

    def __init__(
        self,
        gateway: GatewayClient,
        pool_name: str,
        *,
        parallelism: int,
        lease_seconds: float,
        heartbeat_seconds: float,
        log: Callable[[str], None] | None = None,
        on_finish: OnFinish | None = None,
        max_consecutive_failures: int = 0,
        outage: Outage | None = None,
    ) -> None:
        self.gateway = gateway
        self.pool_name = pool_name
        self.parallelism = parallelism
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.log = log or _log.info
        self.on_finish = on_finish
        self.started = 0
        self.succeeded = 0
        self.failed = 0
        self.released = 0
        self.unreported = 0
        self.failed_by_reason: Counter[str] = Counter()
        self.max_consecutive_failures = max_consecutive_failures
        self.outage = outage
        self.fatal: str | None = None
        self.halted = asyncio.Event()  # set with `fatal`
        self.last_failure: tuple[str, str] | None = None  # (attempt id, reason)
        self._streak: tuple[str, int] = ("", 0)  # (reason key, attempts in a row) failed with no call
        self._active: dict[asyncio.Task[None], Abort] = {}
        limit = self.gateway_concurrency
        self._gate: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        )

    @property
    def running(self) -> int:
        return sum(not t.done() for t in self._active)

    @abstractmethod
    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        """Run one attempt to its outcome; end early (and clean up) once `abort` is set. Raise
        `RunnerFault` when the runner itself is broken."""

    def logs_of(self, attempt_id: str) -> str:
        """Where a user reads what the attempt's harness printed (shown when a run stops early)."""
        return ""

    def halt(self, why: str) -> None:
        """Stop claiming and end the run: rollouts cannot work (the first reason wins)."""
        if self.fatal is None:
            self.fatal = why
            self.halted.set()

    async def run(self, stop: asyncio.Event) -> None:
        stopped = asyncio.create_task(stop.wait())
        idle = self.idle_min_seconds
        try:
            while not stop.is_set() and self.fatal is None:
                self._prune()
                if len(self._active) >= self.parallelism:
                    await asyncio.wait([*self._active, stopped], return_when=asyncio.FIRST_COMPLETED)
                    continue
                attempt = await self._claim()
                if attempt is None:
                    await asyncio.wait([stopped], timeout=idle)
                    idle = min(idle * 2, self.idle_max_seconds)
                    continue
                idle = self.idle_min_seconds
                abort = Abort()
                if stop.is_set() or self.fatal is not None:
                    abort.trigger("stopped")
                self._active[asyncio.create_task(self._attempt(attempt, abort))] = abort
        finally:
            stopped.cancel()
            for abort in self._active.values():
                abort.trigger("stopped")
            while self._active:
                await asyncio.wait(list(self._active))
                self._prune()

    def _prune(self) -> None:
        for task in [t for t in self._active if t.done()]:
            del self._active[task]
            if not task.cancelled() and task.exception() is not None:
                self.log(f"pool {self.pool_name}: attempt task failed: {task.exception()!r}")

    async def _claim(self) -> ClaimedAttempt | None:
        try:
            async with self._gate:
                return await self.gateway.claim(self.pool_name, self.lease_seconds)
        except (GatewayError, httpx.HTTPError) as exc:
            self.log(f"pool {self.pool_name}: claim failed, retrying: {exc}")
            return None

    async def _attempt(self, attempt: ClaimedAttempt, abort: Abort) -> None:
        self.started += 1
        beats = asyncio.create_task(self._heartbeats(attempt, abort))
        start, started_at = time.monotonic(), time.time()
        try:
            if abort.is_set():
                outcome = Outcome.failure(abort.reason)
            else:
                outcome = await self.with_posted_reward(attempt, await self.execute(attempt, abort))
        except RunnerFault as exc:
            self.halt(str(exc))
            outcome = Outcome.released(f"runner fault: {exc}")
        except Exception as exc:
            outcome = Outcome.failure(f"runner error: {type(exc).__name__}: {exc}")
        finally:
            beats.cancel()
        outcome = await self._released_if_not_its_fault(outcome, abort, started_at)
        outcome = replace(outcome, info={**outcome.info, "seconds": round(time.monotonic() - start, 3)})
        if outcome.status == "succeeded":
            self.succeeded += 1
        elif outcome.status == "released":
            self.released += 1
        else:
            self.failed += 1
            self.failed_by_reason[reason_key(outcome.reason or "failed")] += 1
            self.last_failure = (attempt.id, outcome.reason or "failed")
        calls = await self._report(attempt, outcome)
        if calls is None:
            self.unreported += 1
        else:
            self._count_streak(attempt, outcome, calls)
        if self.on_finish is not None:
            self.on_finish(attempt, outcome)

    async def _released_if_not_its_fault(self, outcome: Outcome, abort: Abort, started_at: float) -> Outcome:
        """A stop (Ctrl-C, the run ending) or an infrastructure outage is not the harness's fault."""
        if outcome.status != "failed":
            return outcome
        if abort.is_set() and abort.reason == "stopped":
            return Outcome.released("stopped", **_without_reason(outcome.info))
        if self.outage is not None:
            why = await self.outage(started_at)
            if why is not None:
                return Outcome.released(f"{why} (was: {outcome.reason})", **_without_reason(outcome.info))
        return outcome

    def _count_streak(self, attempt: ClaimedAttempt, outcome: Outcome, calls: int) -> None:
        """Halt after `max_consecutive_failures` attempts in a row failed the same way before any
        model call: such a harness cannot produce anything to train on, and each try costs time."""
        if outcome.status == "released":
            return
        if outcome.status == "succeeded" or calls > 0:
            self._streak = ("", 0)
            return
        key = reason_key(outcome.reason or "failed")
        same, count = self._streak
        self._streak = (key, count + 1 if key == same else 1)
        limit = self.max_consecutive_failures
        if limit and self._streak[1] >= limit:
            logs = self.logs_of(attempt.id)
            fix = fix_for(outcome.reason or "")
            self.halt(
                f"{limit} attempts in a row failed before any model call was recorded: {outcome.reason}"
                + (f"\n  logs of the last one: {logs}" if logs else "")
                + (f"\n  fix: {fix}" if fix else "")
            )

    async def with_posted_reward(self, attempt: ClaimedAttempt, outcome: Outcome) -> Outcome:
        """The outcome to report. The result file's reward wins; only a harness that ended normally
        with no reward in its result (`Outcome.missing_reward`) gets the reward it posted to the
        gateway, and fails with the original reason if it posted none (or the gateway cannot say)."""
        if not outcome.info.get(REWARD_MISSING):
            return outcome
        info = {k: v for k, v in outcome.info.items() if k != REWARD_MISSING}
        for tries in range(1, self.report_tries + 1):
            try:
                async with self._gate:
                    posted = await self.gateway.posted_reward(attempt.id)
                break
            except (GatewayError, httpx.HTTPError) as exc:
                if isinstance(exc, GatewayError) and exc.status < 500:
                    return replace(outcome, info=info)
                if tries == self.report_tries:
                    self.log(f"attempt {attempt.id}: cannot read its posted reward: {exc!r}")
                    return replace(outcome, info=info)
                await asyncio.sleep(0.5 * 2 ** (tries - 1))
        if posted is None:
            return replace(outcome, info=info)
        rest = {k: v for k, v in info.items() if k not in ("reason", "message")}
        extra = {"posted": posted.info} if posted.info else {}
        return Outcome.success(posted.reward, **rest, reward_source="posted", **extra)

    async def _heartbeats(self, attempt: ClaimedAttempt, abort: Abort) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                async with self._gate:
                    await self.gateway.heartbeat(attempt.id, self.lease_seconds)
            except GatewayError as exc:
                if exc.status in (404, 409):
                    self.log(f"attempt {attempt.id}: lease lost, stopping it: {exc.message}")
                    abort.trigger(f"lease lost: {exc.message}")
                    return
                self.log(f"attempt {attempt.id}: heartbeat failed, retrying: {exc}")
            except httpx.HTTPError as exc:
                self.log(f"attempt {attempt.id}: heartbeat failed, retrying: {exc!r}")

    async def _report(self, attempt: ClaimedAttempt, outcome: Outcome) -> int | None:
        """Complete the attempt: the number of model calls recorded for it, or None when the gateway
        would not take it. A 409 means its lease expired meanwhile: the gateway has already requeued
        the rollout, so there is nothing to do."""
        for tries in range(1, self.report_tries + 1):
            try:
                async with self._gate:
                    done, _ = await self.gateway.complete(
                        attempt.id, outcome.status, outcome.reward, outcome.info
                    )
                return done.calls or 0
            except GatewayError as exc:
                if exc.status == 409:
                    self.log(f"attempt {attempt.id}: completion refused, its lease expired: {exc.message}")
                    return None
                if exc.status < 500:
                    self.log(f"attempt {attempt.id}: completion rejected: {exc}")
                    return None
                error: Exception = exc
            except httpx.HTTPError as exc:
                error = exc
            if tries < self.report_tries:
                await asyncio.sleep(0.5 * 2 ** (tries - 1))
        self.log(
            f"attempt {attempt.id}: completion failed {self.report_tries} times, the lease will requeue "
            f"it: {error!r}"
        )
        return None


def _without_reason(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k != "reason"}
