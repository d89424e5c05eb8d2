"""The gateway's durable store: rollout queue with leases, attempts, recorded calls, model versions.

SQLAlchemy 2 async Core over SQLite (embedded default, WAL; aiosqlite) or PostgreSQL (asyncpg), the same
queries on both; the schema is brought up to date on open (migrations.py). Recorded calls go through a
group-commit writer: concurrent calls share one transaction, and each caller is released only after
the commit that holds its record, so an answered call is durable.

Several gateway processes may share one PostgreSQL database (replicas of one run's gateway). What
keeps them correct is in the transactions, not in any one process:
- a claim takes the oldest queued rollouts with `FOR UPDATE SKIP LOCKED`: two claims never take the
  same rollout, and neither waits for the other;
- every change of an attempt (heartbeat, completion, reward, release, expiry) locks its row first
  (`FOR UPDATE`; the lease sweep skips rows another process holds), so two processes never both
  settle one attempt;
- `finish_seq` and `created_seq` come from `counters` rows, locked until commit: numbers are unique
  and become visible in order, so an export cursor never skips a rollout that finished concurrently.
On SQLite, one process writes at a time (`_write_lock`) and `FOR UPDATE` renders as nothing.

A continuation is stored as what it adds to its parent call, for its token ids (`prompt_prefix`) and
for its request body alike, since a harness resends the whole conversation every turn: the body's
conversation list (`messages`, else `input`: whichever is a list first) keeps only the items after
the parent's whole list (`body_prefix` of them). Keys, not protocols: Chat Completions and Anthropic
Messages carry `messages`, Responses `input`, and a body whose list does not extend its parent's
(an edited history, a Responses call that sends only its new items with `previous_response_id`) is
stored whole, so a wrong guess costs bytes, never the round trip. Whether a list extends its parent's
is decided by digest (`body_digest`: every item's JSON text, in order), never by Python equality,
which would take `1` for `true` or `1.0` and ignore key order; every reader rebuilds the exact body.
"""

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import orjson
from sqlalchemy import (
    JSON,
    URL,
    Connection,
    Engine,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from inharness.gateway import schema
from inharness.gateway.codec import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from inharness.gateway.store.migrations import migrate
from inharness.gateway.store.tables import (
    attempts,
    calls,
    counters,
    gateway_workers,
    model_versions,
    posted_rewards,
    progress,
    rollouts,
    serving,
)

SqliteSync = Literal["off", "normal", "full"]
# full: every call's request and response body as the harness sent and got it; none: JSON null, for a
# run that needs only what training reads (token ids, log-probs, the call tree).
Bodies = Literal["full", "none"]
# The keys of a request body that may hold its conversation list, the first that is a list wins.
_BODY_LISTS = ("messages", "input")
_INSERT_CALLS = insert(calls).returning(calls.c.id, sort_by_parameter_order=True)
# The writer's two reads in every record's transaction, built once: building a statement costs more
# Python than running it (`bench/RESULTS.md`, "What issue 17's checks cost").
_LIVE_ATTEMPTS = (
    select(attempts.c.id)
    .where(
        attempts.c.id.in_(bindparam("ids", expanding=True)),
        attempts.c.status == "running",
        attempts.c.lease_expires_at >= bindparam("now"),
    )
    .order_by(attempts.c.id)
    .with_for_update(read=True)
)
_PARENTS = select(
    calls.c.id,
    calls.c.prompt_prefix,
    calls.c.prompt_ids,
    calls.c.response_ids,
    calls.c.body_items,
    calls.c.body_digest,
).where(calls.c.id.in_(bindparam("ids", expanding=True)))
# Ids bound per IN (...): well under SQLite's limit on a statement's parameters.
_IDS_PER_STATEMENT = 500
# A completion's failure_reason when its info gives none.
_DEFAULT_REASONS = {"failed": "failed by runner", "released": schema.RELEASED_BY_RUNNER}


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


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


class Store:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        serialize_writes: bool,
        call_engine: Engine | None = None,
        call_thread: bool = False,
        bodies: Bodies = "full",
    ) -> None:
        self._engine = engine
        self._bodies = bodies
        # SQLite: calls are written with the plain sqlite3 driver, a whole transaction at once,
        # instead of several aiosqlite thread hops per transaction. Without fsync (WAL, synchronous
        # NORMAL) a commit takes ~0.15 ms and runs on the event loop; with fsync it gets a thread.
        self._call_engine = call_engine
        self._call_thread = ThreadPoolExecutor(1, thread_name_prefix="store-calls") if call_thread else None
        # SQLite has one writer; serialising writers here avoids SQLITE_BUSY on lock upgrades.
        self._write_lock = asyncio.Lock() if serialize_writes else None
        self._call_queue: asyncio.Queue[tuple[list[CallRecord], asyncio.Future[None]]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, url: str, *, sqlite_synchronous: SqliteSync = "normal", bodies: Bodies = "full"
    ) -> "Store":
        """Open the store at `url` (`sqlite:///PATH`, or `postgresql://USER:PASSWORD@HOST:PORT/DB`),
        creating it or migrating it to this gateway's schema first (migrations.py). On SQLite,
        `sqlite_synchronous=normal` survives a killed process (WAL); `full` also survives power loss at
        the cost of an fsync per commit. `bodies`: whether calls keep their request and response bodies
        (`Bodies`)."""
        parsed = store_url(url)
        if parsed.get_backend_name() == "sqlite":

            def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sqlite_synchronous.upper()}")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()

            await asyncio.to_thread(_migrate_sqlite, parsed.set(drivername="sqlite"), _pragmas)
            engine = create_async_engine(parsed, connect_args={"timeout": 30})
            call_engine = create_engine(parsed.set(drivername="sqlite"), connect_args={"timeout": 30})
            event.listen(engine.sync_engine, "connect", _pragmas)
            event.listen(call_engine, "connect", _pragmas)
            store = cls(
                engine,
                serialize_writes=True,
                call_engine=call_engine,
                call_thread=sqlite_synchronous == "full",
                bodies=bodies,
            )
        else:
            # pre_ping: a connection the database closed (a restart, a failover) is replaced, not used.
            engine = create_async_engine(parsed, pool_size=10, pool_pre_ping=True)
            try:
                async with engine.begin() as conn:
                    await conn.run_sync(migrate)
            except BaseException:
                await engine.dispose()
                raise
            store = cls(engine, serialize_writes=False, bodies=bodies)
        store._writer = asyncio.create_task(store._write_calls_forever(), name="store-call-writer")
        return store

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
        await self._engine.dispose()
        if self._call_engine is not None:
            self._call_engine.dispose()
        if self._call_thread is not None:
            self._call_thread.shutdown()

    # -- rollouts and attempts -------------------------------------------------------------------

    async def create_rollouts(self, req: schema.CreateRollouts, *, default_max_attempts: int) -> list[str]:
        now = time.time()
        max_attempts = req.max_attempts or default_max_attempts
        rows: list[dict[str, Any]] = []
        async with self._writing() as conn:
            seq = await _take_numbers(conn, "created_seq", len(req.tasks) * req.group_size)
            for task in req.tasks:
                group_id = _new_id("grp")
                for _ in range(req.group_size):
                    seq += 1
                    rows.append(
                        {
                            "id": _new_id("ro"),
                            "group_id": group_id,
                            "pool": req.pool,
                            "task": task,
                            "labels": req.labels,
                            "status": "queued",
                            "max_attempts": max_attempts,
                            "attempts_started": 0,
                            "created_seq": seq,
                            "created_at": now,
                        }
                    )
            await conn.execute(insert(rollouts), rows)
        return [r["id"] for r in rows]

    async def claim(
        self, pool: str, lease_seconds: float, claim_key: str | None = None
    ) -> schema.ClaimedAttempt | None:
        """Start a new attempt on the oldest queued rollout of the pool, or None when none is queued.
        Callers expire passed leases first (`expire_leases`) so that their rollouts are claimable."""
        claimed = await self.claim_many(pool, lease_seconds, 1, claim_key)
        return claimed[0] if claimed else None

    async def claim_many(
        self, pool: str, lease_seconds: float, limit: int, claim_key: str | None = None
    ) -> list[schema.ClaimedAttempt]:
        """Start new attempts on up to `limit` of the pool's oldest queued rollouts, in one transaction:
        a controller starting a hundred pods pays one request and one commit, not a hundred.

        With a `claim_key` that already claimed (a claimer whose answer was lost, say to a gateway
        killed between commit and reply, asking again), the answer is those of its attempts that still
        run, with new API keys (only their hashes are stored) and renewed leases, and no new attempt:
        otherwise they would run unheld until their leases expired and be charged to their rollouts."""
        now = time.time()
        async with self._writing() as conn:
            if claim_key is not None:
                again = await _claimed_again(conn, pool, claim_key, lease_seconds, now)
                if again is not None:
                    return again
            rows = (
                await conn.execute(
                    select(rollouts.c.id, rollouts.c.group_id, rollouts.c.task, rollouts.c.attempts_started)
                    .where(rollouts.c.pool == pool, rollouts.c.status == "queued")
                    .order_by(rollouts.c.created_seq)
                    .limit(limit)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not rows:
                return []
            out: list[schema.ClaimedAttempt] = []
            new_attempts: list[dict[str, Any]] = []
            for row in rows:
                token = "ih-" + secrets.token_urlsafe(24)
                attempt = schema.ClaimedAttempt(
                    id=_new_id("at"),
                    rollout_id=row.id,
                    group_id=row.group_id,
                    seq=row.attempts_started + 1,
                    task=row.task,
                    token=token,
                    lease_expires_at=now + lease_seconds,
                )
                out.append(attempt)
                new_attempts.append(
                    {
                        "id": attempt.id,
                        "rollout_id": row.id,
                        "seq": attempt.seq,
                        "pool": pool,
                        "token_hash": hash_token(token),
                        "status": "running",
                        "lease_seconds": lease_seconds,
                        "claimed_at": now,
                        "lease_expires_at": attempt.lease_expires_at,
                        "info": {},
                        "claim_key": claim_key,
                    }
                )
            await conn.execute(
                update(rollouts)
                .where(rollouts.c.id == bindparam("rollout"))
                .values(status="running", attempts_started=bindparam("started")),
                [{"rollout": a.rollout_id, "started": a.seq} for a in out],
            )
            await conn.execute(insert(attempts), new_attempts)
        return out

    async def heartbeat(self, attempt_id: str, lease_seconds: float | None) -> schema.AttemptOut:
        now = time.time()
        async with self._writing() as conn:
            row = _running(
                await _attempt_row(conn, attempt_id, lock=True), now, "its lease cannot be renewed"
            )
            seconds = lease_seconds or row.lease_seconds
            await conn.execute(
                update(attempts).where(attempts.c.id == attempt_id).values(lease_expires_at=now + seconds)
            )
            row = await _attempt_row(conn, attempt_id)
        return _attempt_out(row)

    async def heartbeat_many(
        self, attempt_ids: Sequence[str], lease_seconds: float | None
    ) -> list[schema.LeaseRenewal]:
        """Renew the leases of those attempts that are running with a live lease, in one transaction
        of at most two statements per `_IDS_PER_STATEMENT` ids: an UPDATE … RETURNING of the renewed
        ones, and a SELECT of the rest only when some were not. One answer per id, in order, saying
        why a lease was not renewed, so that a controller stops the harnesses whose attempts ended."""
        now = time.time()
        unique = list(dict.fromkeys(attempt_ids))
        seconds = lease_seconds if lease_seconds is not None else attempts.c.lease_seconds
        found: dict[str, schema.LeaseRenewal] = {}
        async with self._writing() as conn:
            for start in range(0, len(unique), _IDS_PER_STATEMENT):
                chunk = unique[start : start + _IDS_PER_STATEMENT]
                renewed = await conn.execute(
                    update(attempts)
                    .where(
                        attempts.c.id.in_(chunk),
                        attempts.c.status == "running",
                        attempts.c.lease_expires_at >= now,
                    )
                    .values(lease_expires_at=now + seconds)
                    .returning(attempts.c.id, attempts.c.lease_expires_at)
                )
                for row in renewed:
                    found[row.id] = schema.LeaseRenewal(
                        id=row.id, lease="renewed", status="running", lease_expires_at=row.lease_expires_at
                    )
                rest = [i for i in chunk if i not in found]
                if not rest:
                    continue
                c = attempts.c
                rows = await conn.execute(
                    select(c.id, c.status, c.lease_expires_at, c.failure_reason).where(c.id.in_(rest))
                )
                for row in rows:
                    lost = row.status == "running" or row.failure_reason == "lease expired"
                    found[row.id] = schema.LeaseRenewal(
                        id=row.id,
                        lease="expired" if lost else "finished",
                        status=row.status,
                        lease_expires_at=row.lease_expires_at,
                    )
        unknown = {"lease": "unknown", "status": None, "lease_expires_at": None}
        return [found.get(i) or schema.LeaseRenewal(id=i, **unknown) for i in attempt_ids]

    async def complete(self, attempt_id: str, req: schema.CompleteRequest) -> tuple[schema.AttemptOut, bool]:
        """Finish a running attempt. Returns (attempt, duplicate): repeating the same completion is
        answered with the stored outcome and changes nothing; any other completion of a finished or
        expired attempt is a Conflict. A released attempt's rollout is requeued without being charged.

        The answer counts the attempt's recorded calls. No flush of the call writer is needed: a
        harness gets its answer (or a stream's finish) only after the commit that holds the call, so
        every call it was answered is counted; a call still in flight has answered nobody yet."""
        now = time.time()
        async with self._writing() as conn:
            row = await _attempt_row(conn, attempt_id, lock=True)
            if row.status != "running" or row.lease_expires_at < now:
                same = row.status == req.status and row.reward == req.reward
                if same and row.failure_reason != "lease expired":
                    return _attempt_out(row, calls=await _count_calls(conn, attempt_id)), True
                raise Conflict(f"attempt {attempt_id} is {_attempt_state(row, now)}; completion refused")
            await conn.execute(
                update(attempts)
                .where(attempts.c.id == attempt_id)
                .values(
                    status=req.status,
                    finished_at=now,
                    reward=req.reward,
                    info=req.info,
                    failure_reason=_failure_reason(req),
                )
            )
            await _settle_rollout(conn, row.rollout_id, req.status, req.reward, now)
            row = await _attempt_row(conn, attempt_id)
            return _attempt_out(row, calls=await _count_calls(conn, attempt_id)), False

    async def release_running(self, pool: str, reason: str) -> list[str]:
        """Release every running attempt of the pool, passed leases included, and requeue their
        rollouts uncharged, in one transaction; returns the released attempts' ids. For a runner
        restarting after its process died: the attempts it ran will never complete, and waiting out
        their leases would only delay their rollouts (and charge them an attempt)."""
        now = time.time()
        async with self._writing() as conn:
            running = (
                await conn.execute(
                    select(attempts.c.id, attempts.c.rollout_id)
                    .where(attempts.c.pool == pool, attempts.c.status == "running")
                    .order_by(attempts.c.id)  # one lock order for every process: no deadlock
                    .with_for_update()
                )
            ).all()
            for row in running:
                await conn.execute(
                    update(attempts)
                    .where(attempts.c.id == row.id)
                    .values(status="released", finished_at=now, failure_reason=reason)
                )
                await _settle_rollout(conn, row.rollout_id, "released", None, now)
        return [row.id for row in running]

    async def post_reward(
        self, attempt_id: str, reward: float, info: dict[str, Any]
    ) -> schema.PostedRewardOut:
        """Keep the reward a harness posted for its running attempt; a later post replaces it. Checked
        in the same transaction as the write, so a post never lands on a finished or expired attempt."""
        now = time.time()
        async with self._writing() as conn:
            _running(await _attempt_row(conn, attempt_id, lock=True), now, "its reward cannot change")
            posts = await conn.scalar(
                select(posted_rewards.c.posts).where(posted_rewards.c.attempt_id == attempt_id)
            )
            values = {"reward": float(reward), "info": info, "posted_at": now, "posts": (posts or 0) + 1}
            if posts is None:
                await conn.execute(insert(posted_rewards).values(attempt_id=attempt_id, **values))
            else:
                await conn.execute(
                    update(posted_rewards).where(posted_rewards.c.attempt_id == attempt_id).values(**values)
                )
        return schema.PostedRewardOut(attempt_id=attempt_id, **values)

    async def posted_reward(self, attempt_id: str) -> schema.PostedRewardOut | None:
        async with self._engine.connect() as conn:
            await _attempt_row(conn, attempt_id)
            row = (
                await conn.execute(select(posted_rewards).where(posted_rewards.c.attempt_id == attempt_id))
            ).first()
        if row is None:
            return None
        return schema.PostedRewardOut(
            attempt_id=attempt_id,
            reward=row.reward,
            info=row.info or {},
            posted_at=row.posted_at,
            posts=row.posts,
        )

    async def expire_leases(self, now: float | None = None) -> int:
        """Fail every running attempt whose lease has passed and requeue its rollout (or fail it at
        its attempt limit). Returns how many attempts expired."""
        now = time.time() if now is None else now
        async with self._writing() as conn:
            expired = (
                await conn.execute(
                    select(attempts.c.id, attempts.c.rollout_id)
                    .where(attempts.c.status == "running", attempts.c.lease_expires_at < now)
                    # Another process's sweep, or a completion, holds it: theirs to settle.
                    .with_for_update(skip_locked=True)
                )
            ).all()
            for row in expired:
                await conn.execute(
                    update(attempts)
                    .where(attempts.c.id == row.id)
                    .values(status="failed", finished_at=now, failure_reason="lease expired")
                )
                await _settle_rollout(conn, row.rollout_id, "failed", None, now)
        return len(expired)

    async def get_rollout(self, rollout_id: str) -> schema.RolloutOut:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(rollouts).where(rollouts.c.id == rollout_id))).first()
            if row is None:
                raise NotFound(f"rollout {rollout_id} not found")
            return await _rollout_out(conn, row)

    async def get_rollouts(self, rollout_ids: Sequence[str]) -> list[schema.RolloutOut]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(rollouts).where(rollouts.c.id.in_(rollout_ids)))).all()
            by_id = {r.id: r for r in rows}
            return [await _rollout_out(conn, by_id[i]) for i in rollout_ids if i in by_id]

    async def attempt_by_token(self, token: str) -> AttemptAuth | None:
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        attempts.c.id, attempts.c.rollout_id, attempts.c.status, attempts.c.lease_expires_at
                    ).where(attempts.c.token_hash == hash_token(token))
                )
            ).first()
        if row is None:
            return None
        status = "expired" if row.status == "running" and row.lease_expires_at < time.time() else row.status
        return AttemptAuth(row.id, row.rollout_id, status, row.lease_expires_at)

    async def hold(self, rollout_ids: Sequence[str]) -> int:
        """Move queued rollouts to held, where no claim takes them; running and finished ones are left
        alone. Returns how many changed. For a resumed synchronous run: rollouts made for a later model
        version must wait until that version is served again."""
        return await self._move_rollouts(rollout_ids, "queued", "held")

    async def unhold(self, rollout_ids: Sequence[str]) -> int:
        """Move held rollouts back to queued. Returns how many changed."""
        return await self._move_rollouts(rollout_ids, "held", "queued")

    async def _move_rollouts(self, rollout_ids: Sequence[str], source: str, target: str) -> int:
        changed = 0
        async with self._writing() as conn:
            for start in range(0, len(rollout_ids), _IDS_PER_STATEMENT):
                chunk = list(rollout_ids[start : start + _IDS_PER_STATEMENT])
                result = await conn.execute(
                    update(rollouts)
                    .where(rollouts.c.id.in_(chunk), rollouts.c.status == source)
                    .values(status=target)
                )
                changed += result.rowcount
        return changed

    async def count_rollouts(self, status: str) -> int:
        async with self._engine.connect() as conn:
            return int(await conn.scalar(select(func.count()).where(rollouts.c.status == status)) or 0)

    async def rollout_counts(self) -> dict[str, int]:
        """Rollouts by status, every status present (0 where none), in one grouped query."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(select(rollouts.c.status, func.count()).group_by(rollouts.c.status))
            found = {status: int(n) for status, n in rows}
        return {status: found.get(status, 0) for status in get_args(schema.RolloutStatus)}

    # -- calls -----------------------------------------------------------------------------------

    async def record_calls(self, records: list[CallRecord]) -> None:
        """Durably record calls; returns after the commit that holds them. Sets each record's id.
        Raises AttemptEnded, and records none of them, when their attempt no longer runs with a live
        lease at the commit: checked in the same transaction, so that no completion, release or lease
        sweep (in this process or another) slips between the check and the record."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._call_queue.put((records, done))
        await done

    async def _write_calls_forever(self) -> None:
        """Group commit: every record queued while the previous commit ran goes into the next one."""
        while True:
            batch = [await self._call_queue.get()]
            while not self._call_queue.empty() and len(batch) < 256:
                batch.append(self._call_queue.get_nowait())
            records = [rec for recs, _ in batch for rec in recs]
            try:
                ids = await self._insert_calls(records)
            except Exception as exc:  # every waiter learns that its records were not stored
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for rec, call_id in zip(records, ids, strict=True):
                rec.id = call_id
            for recs, fut in batch:
                ended = next((r.attempt_id for r in recs if r.id is None), None)
                if fut.done():
                    continue
                if ended is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(AttemptEnded(f"attempt {ended} is no longer running"))

    async def _insert_calls(self, records: list[CallRecord]) -> list[int | None]:
        """One transaction of calls. SQLite: the sqlite3 writer (on a thread with fsync), under the
        write lock. PostgreSQL: the async engine, a pooled connection per batch (a connection the
        database dropped is replaced, not kept)."""
        if self._call_engine is None:
            async with self._engine.begin() as conn:
                return await conn.run_sync(
                    lambda sync: _insert_calls(_CoreCalls(sync), records, self._bodies)
                )
        assert self._write_lock is not None
        async with self._write_lock:
            if self._call_thread is None:
                return self._insert_calls_sync(records)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._call_thread, self._insert_calls_sync, records)

    def _insert_calls_sync(self, records: list[CallRecord]) -> list[int | None]:
        assert self._call_engine is not None
        with self._call_engine.begin() as conn:
            return _insert_calls(_SqliteCalls(conn.connection.driver_connection), records, self._bodies)

    async def call_digests(self, attempt_id: str) -> tuple[dict[str, int], dict[str, int], set[str]]:
        """(reply digest -> call id, request digest -> call id, turns digests of the replies) of the
        attempt's calls, latest wins."""
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(calls.c.id, calls.c.reply_digest, calls.c.request_digest, calls.c.turns_digest)
                    .where(calls.c.attempt_id == attempt_id)
                    .order_by(calls.c.id)
                )
            ).all()
        turns = {r.turns_digest for r in rows if r.turns_digest}
        return {r.reply_digest: r.id for r in rows}, {r.request_digest: r.id for r in rows}, turns

    async def find_call_by_reply(
        self, attempt_id: str, digests: Sequence[str]
    ) -> tuple[ParentCall, str] | None:
        """The most recent call of the attempt whose conversation-after-reply digest is one of
        `digests`; the caller passes longer conversations first and gets the first that matches."""
        if not digests:
            return None
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(calls.c.id, calls.c.reply_digest)
                    .where(calls.c.attempt_id == attempt_id, calls.c.reply_digest.in_(list(digests)))
                    .order_by(calls.c.id.desc())
                )
            ).all()
            best: dict[str, int] = {}
            for r in rows:
                best.setdefault(r.reply_digest, r.id)
            found = next((d for d in digests if d in best), None)
            if found is None:
                return None
            chain = await _chain(conn, best[found])
        call = chain[best[found]]
        prompt = _whole_prompt(chain, call.id)
        return ParentCall(call.id, prompt, unpack_ids(call.response_ids), call.finish_reason), found

    async def find_call_by_request(self, attempt_id: str, digest: str) -> list[int] | None:
        """Prompt ids of an earlier call of the attempt asked with exactly this conversation."""
        async with self._engine.connect() as conn:
            call_id = await conn.scalar(
                select(calls.c.id)
                .where(calls.c.attempt_id == attempt_id, calls.c.request_digest == digest)
                .order_by(calls.c.id.desc())
                .limit(1)
            )
            if call_id is None:
                return None
            chain = await _chain(conn, call_id)
        return _whole_prompt(chain, call_id)

    async def call_bodies(
        self, attempt_id: str, request_id: str
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None] | None:
        """(request body, response body) of the attempt's call answered as `request_id` (its first
        choice), each None when the call was recorded without bodies (`Bodies`); None when the attempt
        has no such call."""
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(
                    select(calls.c.id, calls.c.response_body)
                    .where(calls.c.attempt_id == attempt_id, calls.c.request_id == request_id)
                    .order_by(calls.c.choice_index)
                    .limit(1)
                )
            ).first()
            if row is None:
                return None
            chain = await _body_chain(conn, row.id)
        return _whole_bodies(chain)[row.id], row.response_body

    async def list_calls(self, attempt_id: str, *, bodies: bool = True) -> list[schema.CallOut]:
        async with self._engine.connect() as conn:
            if (await conn.scalar(select(attempts.c.id).where(attempts.c.id == attempt_id))) is None:
                raise NotFound(f"attempt {attempt_id} not found")
            rows = (
                await conn.execute(select(calls).where(calls.c.attempt_id == attempt_id).order_by(calls.c.id))
            ).all()
            prompts = await _prompts_of(conn, rows)
            requests = await _bodies_of(conn, rows) if bodies else {}
        return [_call_out(r, prompts[r.id], requests) for r in rows]

    async def export(
        self, *, after: int, limit: int, bodies: bool, status: str | None = None
    ) -> list[schema.ExportedRollout]:
        """Finished rollouts in the order they finished, after cursor `after`, with the calls of
        their final attempt. Resuming from the last cursor seen neither repeats nor skips one."""
        query = (
            select(rollouts)
            .where(rollouts.c.finish_seq.is_not(None), rollouts.c.finish_seq > after)
            .order_by(rollouts.c.finish_seq)
            .limit(limit)
        )
        if status is not None:
            query = query.where(rollouts.c.status == status)
        out: list[schema.ExportedRollout] = []
        async with self._engine.connect() as conn:
            for row in (await conn.execute(query)).all():
                ro = await _rollout_out(conn, row)
                final = ro.attempts[-1].id if ro.attempts else None
                call_rows = (
                    (
                        await conn.execute(
                            select(calls).where(calls.c.attempt_id == final).order_by(calls.c.id)
                        )
                    ).all()
                    if final
                    else []
                )
                prompts = await _prompts_of(conn, call_rows)
                requests = await _bodies_of(conn, call_rows) if bodies else {}
                out.append(
                    schema.ExportedRollout(
                        cursor=row.finish_seq,
                        rollout=ro,
                        calls=[_call_out(c, prompts[c.id], requests) for c in call_rows],
                    )
                )
        return out

    # -- model versions --------------------------------------------------------------------------

    async def register_version(self, version: int, engines: list[str], *, activate: bool) -> None:
        async with self._writing() as conn:
            # An upsert: gateways starting together on one database each register their --engine.
            dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            new = dialect_insert(model_versions).values(
                version=version, engines=engines, active=False, created_at=time.time()
            )
            await conn.execute(
                new.on_conflict_do_update(
                    index_elements=[model_versions.c.version], set_={"engines": engines}
                )
            )
            if activate:
                await _activate(conn, version)

    async def activate_version(self, version: int) -> None:
        async with self._writing() as conn:
            exists = await conn.scalar(
                select(model_versions.c.version).where(model_versions.c.version == version)
            )
            if exists is None:
                raise NotFound(f"model version {version} is not registered")
            await _activate(conn, version)

    async def list_versions(self) -> list[schema.ModelVersionOut]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(model_versions).order_by(model_versions.c.version))).all()
        return [_version_out(r) for r in rows]

    # -- state shared by the gateway's processes -------------------------------------------------

    @property
    def shared(self) -> bool:
        """Whether other processes may use this store (PostgreSQL); a SQLite store has one gateway."""
        return self._write_lock is None

    async def serving(self) -> SharedServing:
        async with self._engine.connect() as conn:
            row = (await conn.execute(select(serving).where(serving.c.id == 1))).one()
        return SharedServing(row.paused, row.resumes_at, row.generation)

    async def set_serving(self, *, paused: bool, resumes_at: float | None) -> SharedServing:
        """Pause (until `resumes_at`) or resume every gateway process on this store; a new generation."""
        async with self._writing() as conn:
            row = (
                await conn.execute(
                    update(serving)
                    .where(serving.c.id == 1)
                    .values(paused=paused, resumes_at=resumes_at, generation=serving.c.generation + 1)
                    .returning(serving.c.paused, serving.c.resumes_at, serving.c.generation)
                )
            ).one()
        return SharedServing(row.paused, row.resumes_at, row.generation)

    async def sync_worker(self, report: WorkerReport) -> tuple[SharedServing, list[schema.ModelVersionOut]]:
        """Record this process's report and read what it must apply: the serving pause and the model
        versions. One transaction, three small statements: a process runs it every poll."""
        async with self._writing() as conn:
            values = {
                "host": report.host,
                "pid": report.pid,
                "seen_at": report.seen_at,
                "generation": report.generation,
                "in_flight": report.in_flight,
                "held": report.held,
            }
            dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            await conn.execute(
                dialect_insert(gateway_workers)
                .values(id=report.id, **values)
                .on_conflict_do_update(index_elements=[gateway_workers.c.id], set_=values)
            )
            row = (await conn.execute(select(serving).where(serving.c.id == 1))).one()
            rows = (await conn.execute(select(model_versions).order_by(model_versions.c.version))).all()
        return SharedServing(row.paused, row.resumes_at, row.generation), [_version_out(r) for r in rows]

    async def workers(self, seen_after: float) -> list[WorkerReport]:
        """The gateway processes that reported after `seen_after`."""
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(select(gateway_workers).where(gateway_workers.c.seen_at > seen_after))
            ).all()
        return [WorkerReport(r.id, r.host, r.pid, r.seen_at, r.generation, r.in_flight, r.held) for r in rows]

    async def forget_worker(self, worker_id: str) -> None:
        """A process stopping: the others need not wait for it."""
        async with self._writing() as conn:
            await conn.execute(delete(gateway_workers).where(gateway_workers.c.id == worker_id))

    async def save_progress(self, board: dict[str, Any]) -> None:
        async with self._writing() as conn:
            dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            await conn.execute(
                dialect_insert(progress)
                .values(id=1, board=board)
                .on_conflict_do_update(index_elements=[progress.c.id], set_={"board": board})
            )

    async def load_progress(self) -> dict[str, Any] | None:
        async with self._engine.connect() as conn:
            return await conn.scalar(select(progress.c.board).where(progress.c.id == 1))

    # -- plumbing --------------------------------------------------------------------------------

    def _writing(self) -> "_WriteTxn":
        return _WriteTxn(self)


class _WriteTxn:
    """`async with store._writing() as conn`: one write transaction, serialised on SQLite."""

    def __init__(self, store: Store) -> None:
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


def _version_out(r: Any) -> schema.ModelVersionOut:
    return schema.ModelVersionOut(
        version=r.version, engines=r.engines, active=r.active, created_at=r.created_at
    )


async def _activate(conn: AsyncConnection, version: int) -> None:
    await conn.execute(update(model_versions).values(active=model_versions.c.version == version))


async def _attempt_row(conn: AsyncConnection, attempt_id: str, *, lock: bool = False) -> Any:
    """The attempt's row; `lock`: locked until the transaction ends, for a change that depends on it."""
    query = select(attempts).where(attempts.c.id == attempt_id)
    row = (await conn.execute(query.with_for_update() if lock else query)).first()
    if row is None:
        raise NotFound(f"attempt {attempt_id} not found")
    return row


async def _claimed_again(
    conn: AsyncConnection, pool: str, claim_key: str, lease_seconds: float, now: float
) -> list[schema.ClaimedAttempt] | None:
    """The running attempts `claim_key` claimed, re-keyed and re-leased; None if it claimed none."""
    a, r = attempts.c, rollouts.c
    rows = (
        await conn.execute(
            select(a.id, a.rollout_id, a.seq, a.status, r.group_id, r.task)
            .join(rollouts, r.id == a.rollout_id)
            .where(a.claim_key == claim_key, a.pool == pool)
            .order_by(r.created_seq)
            .with_for_update(of=attempts)
        )
    ).all()
    if not rows:
        return None
    out = [
        schema.ClaimedAttempt(
            id=row.id,
            rollout_id=row.rollout_id,
            group_id=row.group_id,
            seq=row.seq,
            task=row.task,
            token="ih-" + secrets.token_urlsafe(24),
            lease_expires_at=now + lease_seconds,
        )
        for row in rows
        if row.status == "running"
    ]
    if out:
        await conn.execute(
            update(attempts)
            .where(attempts.c.id == bindparam("attempt"))
            .values(
                token_hash=bindparam("hash"), lease_expires_at=bindparam("until"), lease_seconds=lease_seconds
            ),
            [{"attempt": c.id, "hash": hash_token(c.token), "until": c.lease_expires_at} for c in out],
        )
    return out


def _running(row: Any, now: float, refused: str) -> Any:
    """`row` if its attempt is running with a live lease, else a Conflict saying what is `refused`."""
    if row.status != "running" or row.lease_expires_at < now:
        raise Conflict(f"attempt {row.id} is {_attempt_state(row, now)}; {refused}")
    return row


def _attempt_state(row: Any, now: float) -> str:
    if row.status == "running" and row.lease_expires_at < now:
        return "expired (its lease passed)"
    if row.failure_reason == "lease expired":
        return "expired (its lease passed)"
    return row.status


async def _settle_rollout(
    conn: AsyncConnection, rollout_id: str, status: str, reward: float | None, now: float
) -> None:
    """After an attempt ends: requeue the rollout when the attempt was released, or failed while
    attempts remain; else finish it. Released attempts are not charged: they ended through no fault
    of the harness."""
    ro = (await conn.execute(select(rollouts).where(rollouts.c.id == rollout_id).with_for_update())).first()
    if ro is None or ro.status != "running":
        return
    if status == "released" or (
        status == "failed" and await _charged_attempts(conn, rollout_id) < ro.max_attempts
    ):
        await conn.execute(update(rollouts).where(rollouts.c.id == rollout_id).values(status="queued"))
        return
    seq = await _take_numbers(conn, "finish_seq", 1)
    await conn.execute(
        update(rollouts)
        .where(rollouts.c.id == rollout_id)
        .values(status=status, reward=reward, finished_at=now, finish_seq=seq + 1)
    )


async def _take_numbers(conn: AsyncConnection, counter: str, n: int) -> int:
    """Reserve the next `n` numbers of `counter`; returns the last number before them. The counter's
    row stays locked until the transaction ends, so numbers are handed out in commit order: take them
    as late in a transaction as its work allows."""
    last = await conn.scalar(
        update(counters)
        .where(counters.c.name == counter)
        .values(value=counters.c.value + n)
        .returning(counters.c.value)
    )
    return int(last) - n


async def _charged_attempts(conn: AsyncConnection, rollout_id: str) -> int:
    """Attempts of the rollout that count against its max_attempts: all but the released ones.
    Counted from the attempts themselves, so stores made before releases existed need no migration."""
    return int(
        await conn.scalar(
            select(func.count()).where(attempts.c.rollout_id == rollout_id, attempts.c.status != "released")
        )
        or 0
    )


async def _count_calls(conn: AsyncConnection, attempt_id: str) -> int:
    return int(await conn.scalar(select(func.count()).where(calls.c.attempt_id == attempt_id)) or 0)


def _failure_reason(req: schema.CompleteRequest) -> str | None:
    if req.status == "succeeded":
        return None
    return str(req.info.get("reason") or _DEFAULT_REASONS[req.status])


def _attempt_out(row: Any, *, calls: int | None = None) -> schema.AttemptOut:
    return schema.AttemptOut(
        id=row.id,
        rollout_id=row.rollout_id,
        seq=row.seq,
        status=row.status,
        pool=row.pool,
        claimed_at=row.claimed_at,
        lease_expires_at=row.lease_expires_at,
        finished_at=row.finished_at,
        reward=row.reward,
        failure_reason=row.failure_reason,
        info=row.info or {},
        calls=calls,
    )


async def _rollout_out(conn: AsyncConnection, row: Any) -> schema.RolloutOut:
    att = (
        await conn.execute(select(attempts).where(attempts.c.rollout_id == row.id).order_by(attempts.c.seq))
    ).all()
    return schema.RolloutOut(
        id=row.id,
        group_id=row.group_id,
        pool=row.pool,
        task=row.task,
        labels=row.labels,
        status=row.status,
        reward=row.reward,
        max_attempts=row.max_attempts,
        created_at=row.created_at,
        finished_at=row.finished_at,
        attempts=[_attempt_out(a) for a in att],
    )


def store_url(url: str) -> URL:
    """The store's URL with the async driver it is opened with, or a StoreError naming the forms."""
    forms = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(f"the store is not a database URL; give {forms}") from None
    if parsed.drivername in ("sqlite", "sqlite+aiosqlite", "sqlite+pysqlite"):
        return parsed.set(drivername="sqlite+aiosqlite")
    if parsed.drivername in ("postgresql", "postgresql+asyncpg"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise StoreError(f"a store URL of scheme {parsed.drivername!r} is not supported; give {forms}")


def _migrate_sqlite(url: URL, pragmas: Callable[[Any, Any], None]) -> None:
    """Migrate a SQLite store in one BEGIN IMMEDIATE transaction: its DDL inside it (the sqlite3
    driver would run DDL outside any transaction), and a second process opening the same file waits
    for the first to commit instead of migrating it too."""
    engine = create_engine(url, connect_args={"timeout": 30}, poolclass=NullPool)
    event.listen(engine, "connect", pragmas)

    def _driver_autocommit(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the BEGIN below is the only one

    event.listen(engine, "connect", _driver_autocommit)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    try:
        with engine.begin() as conn:
            migrate(conn)
    finally:
        engine.dispose()


class _CoreCalls:
    """The call writer's three statements on a SQLAlchemy connection (PostgreSQL)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def live(self, attempt_ids: list[str], now: float) -> set[str]:
        """Of `attempt_ids`, those running with a lease not expired at `now`, share-locked."""
        return set(self.conn.execute(_LIVE_ATTEMPTS, {"ids": attempt_ids, "now": now}).scalars())

    def parents(self, ids: list[int]) -> dict[int, Any]:
        """The calls `ids` as `_PARENTS` reads them, by id."""
        return {p.id: p for p in self.conn.execute(_PARENTS, {"ids": ids})}

    def insert(self, rows: list[dict[str, Any]]) -> list[int]:
        """`_call_row`s inserted; their ids in order."""
        return list(self.conn.execute(_INSERT_CALLS, rows).scalars())


class _ParentRow(NamedTuple):
    id: int
    prompt_prefix: int | None
    prompt_ids: bytes
    response_ids: bytes
    body_items: int | None
    body_digest: str | None


# SQLite's call writer: the same statements as plain SQL, written once from tables.py's columns. Run
# through SQLAlchemy, compiling, caching and processing each statement's parameters cost more Python
# than SQLite takes to run it (bench/RESULTS.md). Values go in as SQLAlchemy's SQLite types put them:
# JSON as `json.dumps` text (None as JSON null), the rest as they are; a test compares the rows.
_SQLITE_COLUMNS = [c.name for c in calls.columns if c.name != "id"]
_SQLITE_JSON = {c.name for c in calls.columns if isinstance(c.type, JSON)}
_SQLITE_INSERT = (
    f"INSERT INTO calls ({', '.join(_SQLITE_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_SQLITE_COLUMNS))}) RETURNING id"
)
_SQLITE_PARENT_COLUMNS = ", ".join(_ParentRow._fields)


class _SqliteCalls:
    """The call writer's three statements on the sqlite3 connection of a SQLAlchemy transaction."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def live(self, attempt_ids: list[str], now: float) -> set[str]:
        marks = ", ".join("?" * len(attempt_ids))
        sql = (
            f"SELECT id FROM attempts WHERE id IN ({marks}) AND status = 'running' AND lease_expires_at >= ?"
        )
        return {row[0] for row in self.db.execute(sql, [*attempt_ids, now])}

    def parents(self, ids: list[int]) -> dict[int, Any]:
        marks = ", ".join("?" * len(ids))
        sql = f"SELECT {_SQLITE_PARENT_COLUMNS} FROM calls WHERE id IN ({marks})"
        return {row[0]: _ParentRow(*row) for row in self.db.execute(sql, ids)}

    def insert(self, rows: list[dict[str, Any]]) -> list[int]:
        out = []
        for row in rows:
            values = [json.dumps(row[c]) if c in _SQLITE_JSON else row[c] for c in _SQLITE_COLUMNS]
            out.append(self.db.execute(_SQLITE_INSERT, values).fetchone()[0])
        return out


def _insert_calls(
    db: _CoreCalls | _SqliteCalls, records: Sequence[CallRecord], bodies: Bodies
) -> list[int | None]:
    """Insert the calls in the caller's transaction, each continuation as what it adds to its parent
    (`_prefix`, `_body`), and only those of attempts still running with a live lease (None for the
    others). The attempts' rows stay share-locked until the commit, so a completion (which locks its row
    for update) comes wholly before the check or wholly after the record; on SQLite every write of the
    process is serialised."""
    live = db.live(sorted({r.attempt_id for r in records}), time.time())
    kept = [r for r in records if r.attempt_id in live]
    if not kept:
        return [None] * len(records)
    wanted = {
        r.parent_call_id
        for r in kept
        if r.parent_call_id is not None and (r.prefix_reused or bodies == "full")
    }
    parents = db.parents(sorted(wanted)) if wanted else {}
    rows = [_call_row(rec, parents.get(rec.parent_call_id), bodies) for rec in kept]
    new_ids = iter(db.insert(rows))
    return [next(new_ids) if r.attempt_id in live else None for r in records]


def _prefix(rec: CallRecord, parent: Any) -> int | None:
    """How many leading prompt ids of the record are its parent's prompt and response, and so are not
    stored again; None: the prompt is stored whole (a root, a prompt not built on its parent). Trusts
    `prefix_reused` only as far as it can check: the ids before the prefix's end must be the parent's
    stored ids and response (its whole prompt, for a root), else the prompt is stored whole."""
    if parent is None or not rec.prefix_reused:
        return None
    tail = unpack_ids(parent.prompt_ids) + unpack_ids(parent.response_ids)
    end = (parent.prompt_prefix or 0) + len(tail)
    fits = len(rec.prompt_ids) >= end and list(rec.prompt_ids[end - len(tail) : end]) == tail
    return end if fits else None


def _body(rec: CallRecord, parent: Any, bodies: Bodies) -> dict[str, Any]:
    """The record's body columns: its request body, without the leading items of its conversation list
    that are its parent's whole list when they are (`body_prefix` counts them), and the length and
    digest of its own whole list, for its children to check theirs against."""
    body = rec.request_body
    found = _body_list(body) if bodies == "full" else None
    if found is None:
        stored = body if bodies == "full" else None
        return {"request_body": stored, "body_prefix": None, "body_items": None, "body_digest": None}
    key, items = found
    shared = parent.body_items if parent is not None and parent.body_digest is not None else None
    digest = hashlib.sha256(key.encode())
    head = None  # the digest of the first `shared` items
    for n, item in enumerate(items):
        if n == shared:
            head = digest.hexdigest()[:32]
        digest.update(b"\n")  # orjson's text has no raw newline: two items cannot read as one
        digest.update(orjson.dumps(item))
    whole = digest.hexdigest()[:32]
    head = whole if shared == len(items) else head
    prefix = shared if shared and head == parent.body_digest else None
    return {
        "request_body": body if prefix is None else {**body, key: items[prefix:]},
        "body_prefix": prefix,
        "body_items": len(items),
        "body_digest": whole,
    }


def _body_list(body: dict[str, Any] | None) -> tuple[str, list[Any]] | None:
    """(key, list) of the body's conversation list: the first of `_BODY_LISTS` that is a list."""
    for key in _BODY_LISTS:
        items = None if body is None else body.get(key)
        if isinstance(items, list):
            return key, items
    return None


_CHAIN_COLUMNS = (
    calls.c.id,
    calls.c.parent_call_id,
    calls.c.prompt_prefix,
    calls.c.prompt_ids,
    calls.c.response_ids,
    calls.c.finish_reason,
)


async def _ancestors(
    conn: AsyncConnection, call_id: int, columns: Sequence[Any], prefix: Any, name: str
) -> dict[int, Any]:
    """The call and the ancestors it needs, by id, in one recursive query: a call's parent is read
    while the call's `prefix` column says it is stored as what it adds to that parent."""
    chain = select(*columns).where(calls.c.id == call_id).cte(name, recursive=True)
    parents = (
        select(*columns)
        .join(chain, calls.c.id == chain.c.parent_call_id)
        .where(chain.c[prefix.name].is_not(None))
    )
    chain = chain.union_all(parents)
    return {r.id: r for r in (await conn.execute(select(chain))).all()}


async def _chain(conn: AsyncConnection, call_id: int) -> dict[int, Any]:
    """The call and the ancestors its stored prompt needs."""
    return await _ancestors(conn, call_id, _CHAIN_COLUMNS, calls.c.prompt_prefix, "chain")


_BODY_COLUMNS = (calls.c.id, calls.c.parent_call_id, calls.c.body_prefix, calls.c.request_body)


async def _body_chain(conn: AsyncConnection, call_id: int) -> dict[int, Any]:
    """The call and the ancestors its stored request body needs."""
    return await _ancestors(conn, call_id, _BODY_COLUMNS, calls.c.body_prefix, "body_chain")


async def _bodies_of(conn: AsyncConnection, rows: Sequence[Any]) -> dict[int, dict[str, Any] | None]:
    """Whole request bodies of call rows; ancestors outside `rows` (none, for an attempt's calls) are
    read."""
    known = {r.id: r for r in rows}
    for r in rows:
        if r.body_prefix is not None and r.parent_call_id not in known:
            known.update(await _body_chain(conn, r.parent_call_id))
    return _whole_bodies(known)


def _whole_bodies(known: dict[int, Any]) -> dict[int, dict[str, Any] | None]:
    """The whole request body of every call in `known` (rows with id, parent_call_id, body_prefix,
    request_body; every ancestor a continuation needs among them), parents first. The lists share
    their items with their parents' (the readers only serialise them)."""
    whole: dict[int, dict[str, Any] | None] = {}
    for call_id in sorted(known):  # a parent's id is below its children's
        row = known[call_id]
        body = row.request_body
        if row.body_prefix is not None:
            key, tail = _body_list(body) or ("", [])
            _, items = _body_list(whole[row.parent_call_id]) or ("", [])
            if len(items) != row.body_prefix:
                have = f"its parent has {len(items)}"
                raise StoreError(f"call {row.id} extends {row.body_prefix} items of {key}; {have}")
            body = {**body, key: items + tail}
        whole[call_id] = body
    return whole


async def _prompts_of(conn: AsyncConnection, rows: Sequence[Any]) -> dict[int, list[int]]:
    """Whole prompt ids of call rows; ancestors outside `rows` (none, for an attempt's calls, whose
    parents are its own) are read."""
    known = {r.id: r for r in rows}
    for r in rows:
        if r.prompt_prefix is not None and r.parent_call_id not in known:
            known.update(await _chain(conn, r.parent_call_id))
    return _whole_prompts(known)


def _whole_prompts(known: dict[int, Any]) -> dict[int, list[int]]:
    """The whole prompt ids of every call in `known` (call rows with id, parent_call_id, prompt_prefix,
    prompt_ids, response_ids; every ancestor a continuation needs among them), parents first."""
    whole: dict[int, list[int]] = {}
    for call_id in sorted(known):  # a parent's id is below its children's
        row = known[call_id]
        ids = unpack_ids(row.prompt_ids)
        if row.prompt_prefix is not None:
            parent = known[row.parent_call_id]
            ids = _checked(row, whole[parent.id] + unpack_ids(parent.response_ids)) + ids
        whole[call_id] = ids
    return whole


def _whole_prompt(known: dict[int, Any], call_id: int) -> list[int]:
    """The whole prompt ids of one call, from its chain in `known` (`_chain`): each piece copied once."""
    pieces: list[tuple[Any, list[int]]] = []  # (row, its stored ids), the call first
    row = known[call_id]
    while True:
        pieces.append((row, unpack_ids(row.prompt_ids)))
        if row.prompt_prefix is None:
            break
        parent = known[row.parent_call_id]
        pieces.append((None, unpack_ids(parent.response_ids)))
        row = parent
    ids: list[int] = []
    for piece_row, piece in reversed(pieces):
        if piece_row is not None and piece_row.prompt_prefix is not None:
            _checked(piece_row, ids)
        ids += piece
    return ids


def _checked(row: Any, base: list[int]) -> list[int]:
    """`base`, the ids a continuation's stored ids follow, if it is as long as the row says."""
    if len(base) != row.prompt_prefix:
        raise StoreError(f"call {row.id} extends {row.prompt_prefix} ids; its parent has {len(base)}")
    return base


def _call_row(rec: CallRecord, parent: Any, bodies: Bodies) -> dict[str, Any]:
    prefix = _prefix(rec, parent)
    return {
        "attempt_id": rec.attempt_id,
        "rollout_id": rec.rollout_id,
        "request_id": rec.request_id,
        "choice_index": rec.choice_index,
        "protocol": rec.protocol,
        "requested_model": rec.requested_model,
        "model_version": rec.model_version,
        "engine": rec.engine,
        "prompt_ids": pack_ids(rec.prompt_ids if prefix is None else rec.prompt_ids[prefix:]),
        "prompt_prefix": prefix,
        "response_ids": pack_ids(rec.response_ids),
        "response_logprobs": pack_logprobs(rec.response_logprobs),
        "finish_reason": rec.finish_reason,
        "parent_call_id": rec.parent_call_id,
        "prefix_reused": rec.prefix_reused,
        "prefix_mismatch": rec.prefix_mismatch,
        "request_digest": rec.request_digest,
        "reply_digest": rec.reply_digest,
        "started_at": rec.started_at,
        "first_token_at": rec.first_token_at,
        "finished_at": rec.finished_at,
        "response_body": rec.response_body if bodies == "full" else None,
        "notes": list(rec.notes) or None,
        "turns_digest": rec.turns_digest,
        **_body(rec, parent, bodies),
    }


def _call_out(row: Any, prompt_ids: list[int], requests: dict[int, dict[str, Any] | None]) -> schema.CallOut:
    """The call as the API gives it; its bodies when `requests` holds its whole request body."""
    bodies = row.id in requests
    return schema.CallOut(
        id=row.id,
        attempt_id=row.attempt_id,
        rollout_id=row.rollout_id,
        request_id=row.request_id,
        choice_index=row.choice_index,
        protocol=row.protocol,
        requested_model=row.requested_model,
        model_version=row.model_version,
        engine=row.engine,
        prompt_ids=prompt_ids,
        response_ids=unpack_ids(row.response_ids),
        response_logprobs=unpack_logprobs(row.response_logprobs),
        finish_reason=row.finish_reason,
        parent_call_id=row.parent_call_id,
        prefix_reused=row.prefix_reused,
        prefix_mismatch=row.prefix_mismatch,
        started_at=row.started_at,
        first_token_at=row.first_token_at,
        finished_at=row.finished_at,
        request=requests.get(row.id),
        response=row.response_body if bodies else None,
        notes=row.notes or [],
    )
