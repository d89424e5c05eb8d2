"""The rollout queue and its attempts: creation, claims with leases, heartbeats, completion, rewards,
release and expiry, holds, counts.

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
"""

import secrets
import time
from collections.abc import Sequence
from typing import Any, get_args

from sqlalchemy import (
    bindparam,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from inharness.gateway import schema
from inharness.gateway.store.base import (
    AttemptAuth,
    Conflict,
    NotFound,
    StoreCore,
    hash_token,
    new_id,
)
from inharness.gateway.store.tables import (
    attempts,
    calls,
    counters,
    posted_rewards,
    rollouts,
)

# Ids bound per IN (...): well under SQLite's limit on a statement's parameters.
_IDS_PER_STATEMENT = 500
# A completion's failure_reason when its info gives none.
_DEFAULT_REASONS = {"failed": "failed by runner", "released": schema.RELEASED_BY_RUNNER}


class QueueStore(StoreCore):
    """The rollouts and attempts part of `Store`."""

    async def create_rollouts(self, req: schema.CreateRollouts, *, default_max_attempts: int) -> list[str]:
        now = time.time()
        max_attempts = req.max_attempts or default_max_attempts
        rows: list[dict[str, Any]] = []
        async with self._writing() as conn:
            seq = await _take_numbers(conn, "created_seq", len(req.tasks) * req.group_size)
            for task in req.tasks:
                group_id = new_id("grp")
                for _ in range(req.group_size):
                    seq += 1
                    rows.append(
                        {
                            "id": new_id("ro"),
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
                    id=new_id("at"),
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
            return await rollout_out(conn, row)

    async def get_rollouts(self, rollout_ids: Sequence[str]) -> list[schema.RolloutOut]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(select(rollouts).where(rollouts.c.id.in_(rollout_ids)))).all()
            by_id = {r.id: r for r in rows}
            return [await rollout_out(conn, by_id[i]) for i in rollout_ids if i in by_id]

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


async def rollout_out(conn: AsyncConnection, row: Any) -> schema.RolloutOut:
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
