"""Recorded calls: the group-commit writer, the reads a new turn needs (digests, parents, bodies), the
calls of an attempt, and the export of finished rollouts with their calls.

Recorded calls go through a group-commit writer: concurrent calls share one transaction, and each
caller is released only after the commit that holds its record, so an answered call is durable. On
SQLite they are written with the plain sqlite3 driver, a whole transaction at once (`_SqliteCalls`);
on PostgreSQL through SQLAlchemy Core (`_CoreCalls`), the same statements.

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
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson
from sqlalchemy import (
    JSON,
    Connection,
    bindparam,
    insert,
    select,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from inharness.gateway import schema
from inharness.gateway.codec import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from inharness.gateway.store.base import (
    AttemptEnded,
    Bodies,
    CallRecord,
    NotFound,
    ParentCall,
    StoreCore,
    StoreError,
)
from inharness.gateway.store.queue import rollout_out
from inharness.gateway.store.tables import (
    attempts,
    calls,
    rollouts,
)

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


class CallStore(StoreCore):
    """The recorded calls part of `Store`, and the export."""

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
                ro = await rollout_out(conn, row)
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
