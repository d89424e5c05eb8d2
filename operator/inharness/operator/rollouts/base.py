"""The claiming controller: claim queued attempts of one pool from the gateway, run one harness per
attempt, and report each outcome. The claim loop, leases, reporting and counting are the same
whatever runs the harness, so they live here; a backend (local processes, Kubernetes pods or Jobs)
says how to run one attempt to an `Outcome` (`execute`) and, where it needs to, fills in the hooks:

- `begin` / `end`: before the first claim (adopt what a previous controller left, start watches) and
  after the last attempt was reported (stop them, close what the backend opened);
- `claim`: attempts for the free slots (default: one claim; a backend may claim batches);
- `prepare`: what a batch of claimed attempts needs before they start (objects they share);
- `settle`: before an outcome is reported (end what still runs);
- `reported`: after it was (cleanup, or keeping for inspection);
- `attempt_done`: when an attempt's task ends, reported or `Detached`.

Leases: every attempt in flight is renewed by one `POST /api/v1/attempts/heartbeat-batch` per
`heartbeat_seconds` for the whole controller (`renew_leases`), not one request per attempt, so that
gateway requests per attempt stay near one (its completion, and its share of a claim batch) however
long harnesses run; an attempt the gateway says ended or expired is aborted as "lease lost".

`retry` and `backoff` are the one retry policy of every backend: tries doubling their wait. A claim
that fails (the gateway unreachable, a 5xx) is retried that way with jitter, up to
`claim_retry_cap`; a backend that claims by itself reports each failure with `claim_failed`. The
first failure is logged through `warn` with its reason, then one line at most every
`claim_summary_seconds`, and `claim_trouble` says it to whoever writes a status.
"""

import asyncio
import contextlib
import logging
import random
import secrets
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

import httpx

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import MAX_HEARTBEAT_BATCH, ClaimedAttempt, LeaseRenewal
from inharness.operator.rollouts.outcome import REWARD_MISSING, Outcome, fix_for, reason_key, without_reason
from inharness.operator.spec import HarnessSpecSpec, RolloutPoolSpec

_log = logging.getLogger(__name__)

T = TypeVar("T")

Report = Literal["accepted", "duplicate", "refused"]
"""How the gateway took an outcome: accepted, a duplicate of an earlier report (after a restart; it
changes nothing), or refused (the lease expired and the rollout was requeued, or the gateway could
not be reached and the lease will do that)."""

OnFinish = Callable[[ClaimedAttempt, Outcome], None]
OnReport = Callable[[ClaimedAttempt, Outcome, Report], None]

Outage = Callable[[float], Awaitable[str | None]]
"""Why a failure of an attempt that started at this time (time.time()) is the infrastructure's
fault, e.g. "engine was killed by SIGKILL"; None when nothing was down."""


def backoff(tries: int, first: float = 0.5, cap: float = 10.0, jitter: float = 0.0) -> float:
    """Seconds to wait after the `tries`-th failure in a row: first, 2 * first, 4 * first, ... ≤ cap;
    with `jitter` (0..1) a random part of it less (at most that fraction), so that many clients
    failing at once do not retry in step."""
    return min(cap, first * 2 ** (max(tries, 1) - 1)) * (1.0 - jitter * random.random())


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    tries: int,
    transient: Callable[[Exception], bool],
    first: float = 0.5,
    within: float = 0.0,
    cap: float = 10.0,
) -> T:
    """`await call()`, again after `backoff` (at most `cap`) while it raises a `transient` error: at
    least `tries` times, and on until `within` seconds have passed; any other error, or the last
    try's, is raised."""
    deadline = time.monotonic() + within
    n = 0
    while True:
        n += 1
        try:
            return await call()
        except Exception as exc:
            if not transient(exc) or (n >= tries and time.monotonic() >= deadline):
                raise
        await asyncio.sleep(backoff(n, first, cap))


def gateway_transient(exc: Exception) -> bool:
    """A gateway error that may pass on another try: a 5xx or no answer at all."""
    return isinstance(exc, httpx.HTTPError) or (isinstance(exc, GatewayError) and exc.status >= 500)


def pool_settings(pool: RolloutPoolSpec, harness: HarnessSpecSpec) -> dict[str, Any]:
    """What a RolloutPool sets of its controller, whichever the backend: parallelism, lease, heartbeat."""
    return {
        "parallelism": pool.parallelism,
        "lease_seconds": pool.lease_for(harness),
        "heartbeat_seconds": pool.heartbeat_seconds,
    }


@dataclass
class ClaimTrouble:
    """Claims failing in a row: why (the last error), since when (time.time()), how many rounds."""

    reason: str
    since: float
    tries: int = 1
    said: float = 0.0  # time.monotonic() of the last log line about it

    @property
    def seconds(self) -> float:
        return time.time() - self.since


class RunnerFault(Exception):
    """The runner itself cannot run attempts (it cannot write its own files, say): the attempt is
    released and the controller stops with this message, rather than burning every attempt."""


class Detached(Exception):
    """Raised by `execute` when the controller stops while the attempt's harness runs on where a next
    controller can adopt it (a pod): the attempt is neither reported nor counted."""


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


class ClaimingController(ABC):
    """Keeps up to `parallelism` attempts of `pool_name` running: claims while below it, polls with
    a bounded backoff while the queue is empty, renews the leases of all its attempts in one batch
    request per `heartbeat_seconds`, and reports each attempt's outcome. On `stop`, claiming ends,
    running attempts are aborted and released (reason "stopped", not charged to their rollouts) or
    detached, and `run` returns once every one of them is settled.

    Counting: `succeeded`, `failed` (with `failed_by_reason`, `last_failure`) and `released` count
    every outcome this controller settled, except a `duplicate` report (the controller that
    reported first counted it); `unreported` counts those the gateway refused. `on_finish` is
    called for each outcome the gateway accepted, `on_report` for every report.

    It also stops by itself, with `fatal` saying why, when rollouts cannot work: after
    `max_consecutive_failures` attempts in a row failed the same way (`reason_key`) before any model
    call was recorded (a missing harness command, a harness that crashes at import), or at a
    `RunnerFault`. `outage`, when given, turns a failure during an infrastructure outage into a
    release."""

    idle_min_seconds = 0.05
    idle_max_seconds = 0.5
    claim_retry_first = 0.5  # the wait after a failed claim, doubling (with jitter) up to the cap
    claim_retry_cap = 10.0
    claim_summary_seconds = 30.0  # while claims fail, one log line at most this often
    report_tries = 3
    # A completion is retried through a gateway outage this long (at most a lease, which is renewed
    # meanwhile): a restarted gateway must not cost a finished attempt its result. Not while stopping.
    report_seconds = 60.0
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
        on_report: OnReport | None = None,
        max_consecutive_failures: int = 0,
        outage: Outage | None = None,
    ) -> None:
        self.gateway = gateway
        self.pool_name = pool_name
        self.parallelism = parallelism
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.log = log or _log.info
        # Where claim trouble is said: a backend's owner may point it at a higher log level.
        self.warn: Callable[[str], None] = log or _log.warning
        self.claim_trouble: ClaimTrouble | None = None
        self._claim_failed_now = False
        self.on_finish = on_finish
        self.on_report = on_report
        self.started = 0
        self.succeeded = 0
        self.failed = 0
        self.released = 0
        self.unreported = 0
        self.duplicates = 0
        self.failed_by_reason: Counter[str] = Counter()
        self.max_consecutive_failures = max_consecutive_failures
        self.outage = outage
        self.fatal: str | None = None
        self.halted = asyncio.Event()  # set with `fatal`
        self.last_failure: tuple[str, str] | None = None  # (attempt id, reason)
        self._streak: tuple[str, int] = ("", 0)  # (reason key, attempts in a row) failed with no call
        self._active: dict[asyncio.Task[None], Abort] = {}
        # Attempts whose harness runs, by id: what `renew_leases` renews, and what it aborts.
        self.leases: dict[str, tuple[ClaimedAttempt, Abort]] = {}
        self._lease_keeper: asyncio.Task[None] | None = None
        self._batch_heartbeats = True  # False once the gateway answered heartbeat-batch with a 404
        self._claim_key: str | None = None  # see `claim_key`
        self._freed = asyncio.Event()  # an attempt task ended: a slot may be free
        self.stopping = asyncio.Event()  # `run` is ending: running attempts are being aborted
        limit = self.gateway_concurrency
        self.gate: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        )

    @property
    def running(self) -> int:
        return sum(not t.done() for t in self._active)

    # -- what a backend provides --------------------------------------------------------------------

    @abstractmethod
    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        """Run one attempt to its outcome; end early (and clean up) once `abort` is set. Raise
        `RunnerFault` when the runner itself is broken, `Detached` to leave it to a next controller."""

    def logs_of(self, attempt_id: str) -> str:
        """Where a user reads what the attempt's harness printed (shown when a run stops early)."""
        return ""

    def log_tail(self, attempt_id: str) -> list[str]:
        """The last lines the attempt's harness wrote to stderr (bounded; empty where the backend cannot
        read them), shown with `logs_of` so that a user sees the error without opening a file."""
        return []

    async def begin(self) -> None:
        """Before the first claim."""
        return None

    async def end(self) -> None:
        """After the last attempt was settled (also when `begin` or the loop failed)."""
        return None

    async def claim(self, free: int, stopped: "asyncio.Future[Any]") -> list[ClaimedAttempt]:
        """Attempts for up to `free` slots; [] when none is queued (or the claim failed)."""
        attempt = await self.claim_one()
        return [] if attempt is None else [attempt]

    async def prepare(self, attempts: list[ClaimedAttempt]) -> None:
        """What these claimed attempts need before they start."""
        return None

    async def settle(self, attempt: ClaimedAttempt, outcome: Outcome) -> None:
        """Before the outcome is reported."""
        return None

    async def reported(self, attempt: ClaimedAttempt, outcome: Outcome, report: Report) -> None:
        """After the outcome was reported (or refused)."""
        return None

    def attempt_done(self, attempt: ClaimedAttempt) -> None:
        """The attempt's task ends (reported or detached)."""
        return None

    # -- the loop -----------------------------------------------------------------------------------

    def halt(self, why: str) -> None:
        """Stop claiming and end the run: rollouts cannot work (the first reason wins)."""
        if self.fatal is None:
            self.fatal = why
            self.halted.set()

    def free_slots(self) -> int:
        self._prune()
        return self.parallelism - len(self._active)

    async def wait_for_slot(self, stopped: "asyncio.Future[Any]", within: float | None = None) -> None:
        """Until an attempt ends, `stopped` is done, or `within` seconds pass. One event rather than a wait
        on every attempt's task, which would cost O(parallelism) per attempt."""
        self._freed.clear()
        freed = asyncio.create_task(self._freed.wait())
        await asyncio.wait([freed, stopped], timeout=within, return_when=asyncio.FIRST_COMPLETED)
        freed.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await self.begin()
            await self._claim_loop(stop, stopped)
        finally:
            stopped.cancel()
            self.stopping.set()
            for abort in self._active.values():
                abort.trigger("stopped")
            while self._active:
                await asyncio.wait(list(self._active))
                self._prune()
            await self.end()

    async def _claim_loop(self, stop: asyncio.Event, stopped: "asyncio.Future[Any]") -> None:
        idle_polls = 0
        while not stop.is_set() and self.fatal is None:
            free = self.free_slots()
            if free <= 0:
                await self.wait_for_slot(stopped)
                continue
            self._claim_failed_now = False
            attempts = await self.claim(free, stopped)
            trouble = self.claim_trouble
            if trouble is not None and not self._claim_failed_now:
                self.claim_trouble = None
                self.log(f"pool {self.pool_name}: claiming again after {trouble.seconds:.0f} s of failures")
            if not attempts:
                if self._claim_failed_now and trouble is not None:
                    wait = backoff(trouble.tries, self.claim_retry_first, self.claim_retry_cap, jitter=0.5)
                else:
                    idle_polls += 1
                    wait = backoff(idle_polls, self.idle_min_seconds, self.idle_max_seconds)
                await asyncio.wait([stopped], timeout=wait)
                continue
            idle_polls = 0
            await self.prepare(attempts)
            for attempt in attempts:
                abort = Abort()
                if stop.is_set() or self.fatal is not None:
                    abort.trigger("stopped")
                self.spawn(attempt, abort)

    def spawn(self, attempt: ClaimedAttempt, abort: Abort | None = None) -> None:
        """Run the attempt in a task of its own (also for attempts adopted from a previous controller)."""
        abort = abort or Abort()
        self._active[asyncio.create_task(self._attempt(attempt, abort))] = abort

    def _prune(self) -> None:
        for task in [t for t in self._active if t.done()]:
            del self._active[task]
            if not task.cancelled() and task.exception() is not None:
                self.log(f"pool {self.pool_name}: attempt task failed: {task.exception()!r}")

    async def claim_one(self, *, keyed: bool = True) -> ClaimedAttempt | None:
        """One attempt or None; `keyed=False` for claims sent concurrently (each would need its own key)."""
        try:
            async with self.gate:
                attempt = await self.gateway.claim(
                    self.pool_name, self.lease_seconds, self.claim_key() if keyed else None
                )
        except (GatewayError, httpx.HTTPError) as exc:
            self.claim_failed(exc)
            return None
        self.claim_answered()
        return attempt

    def claim_key(self) -> str:
        """The next claim's key: the last one's while no answer came back, so that a claim the gateway
        committed but could not answer (killed in between) is answered by the repeat, else a new one."""
        if self._claim_key is None:
            self._claim_key = secrets.token_hex(16)
        return self._claim_key

    def claim_answered(self) -> None:
        self._claim_key = None

    def claim_failed(self, exc: Exception) -> None:
        """A claim request failed: the claim loop backs off (doubling, with jitter) until one passes.
        Said once with the reason, then at most every `claim_summary_seconds`; several failures in
        one claim round (a wave of single claims) count as one try."""
        reason = (f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))[:500]
        now = time.monotonic()
        trouble = self.claim_trouble
        if trouble is None:
            self.claim_trouble = ClaimTrouble(reason, time.time(), said=now)
            self.warn(f"pool {self.pool_name}: cannot claim from the gateway, backing off: {reason}")
        else:
            trouble.reason = reason
            trouble.tries += 0 if self._claim_failed_now else 1
            if now - trouble.said >= self.claim_summary_seconds:
                trouble.said = now
                self.warn(
                    f"pool {self.pool_name}: claim still failing for {trouble.seconds:.0f} s "
                    f"({trouble.tries} tries): {reason}"
                )
        self._claim_failed_now = True

    # -- one attempt --------------------------------------------------------------------------------

    async def _attempt(self, attempt: ClaimedAttempt, abort: Abort) -> None:
        self.started += 1
        start, started_at = time.monotonic(), time.time()
        self._keep_lease(attempt, abort)  # until it is reported: a completion may wait out an outage
        try:
            try:
                outcome = await self._outcome(attempt, abort)
            except Detached:
                return
            outcome = await self._released_if_not_its_fault(outcome, abort, started_at)
            outcome = replace(outcome, info={**outcome.info, "seconds": round(time.monotonic() - start, 3)})
            await self.settle(attempt, outcome)
            report, calls = await self._report(attempt, outcome)
            self._count(attempt, outcome, report, calls)
            await self.reported(attempt, outcome, report)
        finally:
            self._drop_lease(attempt.id)
            self.attempt_done(attempt)
            self._freed.set()

    async def _outcome(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        """`execute`, with a reward the harness posted where its result had none."""
        if abort.is_set():
            return Outcome.failure(abort.reason)
        try:
            return await self.with_posted_reward(attempt, await self.execute(attempt, abort))
        except RunnerFault as exc:
            self.halt(str(exc))
            return Outcome.released(f"runner fault: {exc}")
        except Detached:
            raise
        except Exception as exc:
            return Outcome.failure(f"runner error: {type(exc).__name__}: {exc}")

    async def _released_if_not_its_fault(self, outcome: Outcome, abort: Abort, started_at: float) -> Outcome:
        """A stop (Ctrl-C, the run ending) or an infrastructure outage is not the harness's fault."""
        if outcome.status != "failed":
            return outcome
        if abort.is_set() and abort.reason == "stopped":
            return Outcome.released("stopped", **without_reason(outcome.info))
        if self.outage is not None:
            why = await self.outage(started_at)
            if why is not None:
                return Outcome.released(f"{why} (was: {outcome.reason})", **without_reason(outcome.info))
        return outcome

    def _count(self, attempt: ClaimedAttempt, outcome: Outcome, report: Report, calls: int) -> None:
        if report == "duplicate":
            self.duplicates += 1
        elif outcome.status == "succeeded":
            self.succeeded += 1
        elif outcome.status == "released":
            self.released += 1
        else:
            self.failed += 1
            self.failed_by_reason[reason_key(outcome.reason or "failed")] += 1
            self.last_failure = (attempt.id, outcome.reason or "failed")
        if report == "refused":
            self.unreported += 1
        elif report == "accepted":
            self._count_streak(attempt, outcome, calls)
            if self.on_finish is not None:
                self.on_finish(attempt, outcome)
        if self.on_report is not None:
            self.on_report(attempt, outcome, report)

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
            tail = "".join(f"\n    {line}" for line in self.log_tail(attempt.id))
            fix = fix_for(outcome.reason or "")
            self.halt(
                f"{limit} attempts in a row failed before any model call was recorded: {outcome.reason}"
                + (f"\n  logs of the last one: {logs}" if logs else "")
                + (f"\n  the end of its stderr:{tail}" if tail else "")
                + (f"\n  fix: {fix}" if fix else "")
            )

    async def with_posted_reward(self, attempt: ClaimedAttempt, outcome: Outcome) -> Outcome:
        """The outcome to report. The result file's reward wins; only a harness that ended normally
        with no reward in its result (`Outcome.missing_reward`) gets the reward it posted to the
        gateway, and fails with the original reason if it posted none (or the gateway cannot say)."""
        if not outcome.info.get(REWARD_MISSING):
            return outcome
        info = {k: v for k, v in outcome.info.items() if k != REWARD_MISSING}

        async def read() -> Any:
            async with self.gate:
                return await self.gateway.posted_reward(attempt.id)

        try:
            posted = await retry(read, tries=self.report_tries, transient=gateway_transient)
        except (GatewayError, httpx.HTTPError) as exc:
            if gateway_transient(exc):
                self.log(f"attempt {attempt.id}: cannot read its posted reward: {exc!r}")
            return replace(outcome, info=info)
        if posted is None:
            return replace(outcome, info=info)
        rest = {k: v for k, v in info.items() if k not in ("reason", "message")}
        extra = {"posted": posted.info} if posted.info else {}
        return Outcome.success(posted.reward, **rest, reward_source="posted", **extra)

    async def heartbeat(self, attempt: ClaimedAttempt, abort: Abort) -> bool:
        """Renew one attempt's lease at once (an adopted attempt, before it waits for the next batch);
        False (and `abort` set) when the gateway says it is lost."""
        try:
            async with self.gate:
                await self.gateway.heartbeat(attempt.id, self.lease_seconds)
        except GatewayError as exc:
            if exc.status in (404, 409):
                self.log(f"attempt {attempt.id}: lease lost, stopping it: {exc.message}")
                abort.trigger(f"lease lost: {exc.message}")
                return False
            self.log(f"attempt {attempt.id}: heartbeat failed, retrying: {exc}")
        except httpx.HTTPError as exc:
            self.log(f"attempt {attempt.id}: heartbeat failed, retrying: {exc!r}")
        return True

    def _keep_lease(self, attempt: ClaimedAttempt, abort: Abort) -> None:
        """Renew the attempt's lease from now on, with the others; the keeper runs while any is held."""
        self.leases[attempt.id] = (attempt, abort)
        if self._lease_keeper is None or self._lease_keeper.done():
            self._lease_keeper = asyncio.create_task(self._keep_leases(), name=f"leases-{self.pool_name}")

    def _drop_lease(self, attempt_id: str) -> None:
        self.leases.pop(attempt_id, None)
        if not self.leases and self._lease_keeper is not None:
            self._lease_keeper.cancel()
            self._lease_keeper = None

    async def _keep_leases(self) -> None:
        """`renew_leases` every `heartbeat_seconds`, counted from start to start, so that a slow gateway
        does not stretch the interval past a lease."""
        due = time.monotonic()
        while self.leases:
            due = max(due + self.heartbeat_seconds, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
            await self.renew_leases()

    async def renew_leases(self) -> None:
        """Renew every held lease: one request per `MAX_HEARTBEAT_BATCH` attempts. A request that fails is
        tried again at the next interval (the lease outlives several); an attempt the gateway says
        ended, expired or does not know is aborted, as its harness's work can no longer count. From a
        gateway that predates batch heartbeats (404), `renew_each` from then on."""
        ids = list(self.leases)
        for start in range(0, len(ids) if self._batch_heartbeats else 0, MAX_HEARTBEAT_BATCH):
            chunk = ids[start : start + MAX_HEARTBEAT_BATCH]
            try:
                async with self.gate:
                    renewals = await self.gateway.heartbeat_batch(chunk, self.lease_seconds)
            except (GatewayError, httpx.HTTPError) as exc:
                if isinstance(exc, GatewayError) and exc.status in (404, 405):
                    self.log(f"pool {self.pool_name}: the gateway has no batch heartbeats; one per attempt")
                    self._batch_heartbeats = False
                    break
                self.log(
                    f"pool {self.pool_name}: heartbeat of {len(chunk)} attempts failed, retrying: {exc!r}"
                )
                continue
            for renewal in renewals:
                if renewal.lease != "renewed":
                    self._lease_lost(renewal)
        if not self._batch_heartbeats:
            await self.renew_each()

    async def renew_each(self) -> None:
        """One heartbeat request per held lease, through the gate: what a gateway without batch
        heartbeats needs, `in flight / heartbeat_seconds` requests a second."""

        async def renew(attempt: ClaimedAttempt, abort: Abort) -> None:
            if not await self.heartbeat(attempt, abort):
                self.leases.pop(attempt.id, None)

        await asyncio.gather(*(renew(attempt, abort) for attempt, abort in list(self.leases.values())))

    def _lease_lost(self, renewal: LeaseRenewal) -> None:
        held = self.leases.pop(renewal.id, None)
        if held is None:  # it ended while the request was in flight
            return
        why = {
            "finished": f"attempt {renewal.id} is {renewal.status}",
            "expired": f"attempt {renewal.id} is expired (its lease passed)",
            "unknown": f"attempt {renewal.id} is unknown to the gateway",
        }[renewal.lease]
        self.log(f"attempt {renewal.id}: lease lost, stopping it: {why}")
        held[1].trigger(f"lease lost: {why}")

    async def _report(self, attempt: ClaimedAttempt, outcome: Outcome) -> tuple[Report, int]:
        """Complete the attempt at the gateway: how it took it, and the model calls recorded for it. A
        409 means its lease expired meanwhile: the gateway has already requeued the rollout."""

        async def complete() -> Any:
            async with self.gate:
                return await self.gateway.complete(attempt.id, outcome.status, outcome.reward, outcome.info)

        try:
            within = 0.0 if self.stopping.is_set() else min(self.report_seconds, self.lease_seconds)
            done, duplicate = await retry(
                complete, tries=self.report_tries, transient=gateway_transient, within=within, cap=2.0
            )
        except GatewayError as exc:
            if exc.status == 409:
                self.log(f"attempt {attempt.id}: completion refused, its lease expired: {exc.message}")
            elif exc.status < 500:
                self.log(f"attempt {attempt.id}: completion refused: {exc}")
            else:
                self._unreachable(attempt, exc)
            return "refused", 0
        except httpx.HTTPError as exc:
            self._unreachable(attempt, exc)
            return "refused", 0
        return ("duplicate" if duplicate else "accepted"), done.calls or 0

    def _unreachable(self, attempt: ClaimedAttempt, exc: Exception) -> None:
        self.log(
            f"attempt {attempt.id}: completion failed through its retries, the lease will requeue it: {exc!r}"
        )
