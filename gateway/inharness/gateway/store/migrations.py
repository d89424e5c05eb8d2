"""The store's schema history: one explicit, ordered list of migrations, applied when a store opens.

`migrate` runs in one transaction (DDL included, on both SQLite and PostgreSQL): it takes the store's
migration lock, reads the version (`schema_version`: one row per applied migration), applies the
migrations after it in order and records each. A gateway upgraded in place therefore keeps its run's
data, and gateways starting together on one PostgreSQL database migrate it once (the others wait for
the lock, then find nothing to do). A store newer than this gateway is refused rather than guessed at.

Each migration is written against the tables as they were at its version, never against `tables.py`
(which is the schema now): a later change to `tables.py` must come with a new migration, and a test
checks that a store migrated from nothing has exactly the tables, columns and indexes of `tables.py`.

Stores made before this list existed (no `schema_version`) hold some prefix of migrations 1-4; those
four check what exists before they create or add it, so such a store starts at version 0 like a new one.
Migrations from 5 on may assume the version they follow.

Why not Alembic: the whole history is nine small migrations; a runner of twenty lines with one lock
is easier to read, test and trust than an extra dependency with its own environment and config.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.schema import CreateColumn
from sqlalchemy.types import TypeEngine

from inharness.gateway.store.tables import schema_version

# pg_advisory_xact_lock's key: "inharnes" as a 64-bit integer. Held until the migration commits.
_LOCK_KEY = int.from_bytes(b"inharnes", "big") >> 1


class SchemaTooNew(Exception):
    """The store was migrated by a newer gateway than this one."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Connection], None]


def _first_tables(conn: Connection) -> None:
    """The tables of the first stores (calls without `notes` and `turns_digest`)."""
    md = MetaData()
    call_id = BigInteger().with_variant(Integer(), "sqlite")
    Table(
        "rollouts",
        md,
        Column("id", String(40), primary_key=True),
        Column("group_id", String(40), nullable=False, index=True),
        Column("pool", String(253), nullable=False),
        Column("task", JSON, nullable=False),
        Column("labels", JSON, nullable=False),
        Column("status", String(16), nullable=False),
        Column("reward", Float),
        Column("max_attempts", Integer, nullable=False),
        Column("attempts_started", Integer, nullable=False),
        Column("created_seq", Integer, nullable=False),
        Column("created_at", Float, nullable=False),
        Column("finished_at", Float),
        Column("finish_seq", Integer, unique=True),
        Index("ix_rollouts_claim", "pool", "status", "created_seq"),
    )
    Table(
        "attempts",
        md,
        Column("id", String(40), primary_key=True),
        Column("rollout_id", String(40), ForeignKey("rollouts.id"), nullable=False, index=True),
        Column("seq", Integer, nullable=False),
        Column("pool", String(253), nullable=False),
        Column("token_hash", String(64), nullable=False, unique=True),
        Column("status", String(16), nullable=False),
        Column("lease_seconds", Float, nullable=False),
        Column("claimed_at", Float, nullable=False),
        Column("lease_expires_at", Float, nullable=False),
        Column("finished_at", Float),
        Column("reward", Float),
        Column("failure_reason", Text),
        Column("info", JSON, nullable=False),
        Index("ix_attempts_lease", "status", "lease_expires_at"),
    )
    Table(
        "calls",
        md,
        Column("id", call_id, primary_key=True, autoincrement=True),
        Column("attempt_id", String(40), ForeignKey("attempts.id"), nullable=False),
        Column("rollout_id", String(40), nullable=False),
        Column("request_id", String(64), nullable=False),
        Column("choice_index", Integer, nullable=False),
        Column("protocol", String(32), nullable=False),
        Column("requested_model", Text, nullable=False),
        Column("model_version", Integer, nullable=False),
        Column("engine", Text, nullable=False),
        Column("prompt_ids", LargeBinary, nullable=False),
        Column("response_ids", LargeBinary, nullable=False),
        Column("response_logprobs", LargeBinary, nullable=False),
        Column("finish_reason", String(16), nullable=False),
        Column("parent_call_id", call_id),
        Column("prefix_reused", Boolean, nullable=False),
        Column("prefix_mismatch", String(64)),
        Column("request_digest", String(32), nullable=False),
        Column("reply_digest", String(32), nullable=False),
        Column("started_at", Float, nullable=False),
        Column("first_token_at", Float),
        Column("finished_at", Float, nullable=False),
        Column("request_body", JSON, nullable=False),
        Column("response_body", JSON, nullable=False),
        Index("ix_calls_attempt", "attempt_id", "id"),
        Index("ix_calls_reply", "attempt_id", "reply_digest"),
        Index("ix_calls_request", "attempt_id", "request_digest"),
    )
    Table(
        "model_versions",
        md,
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("engines", JSON, nullable=False),
        Column("active", Boolean, nullable=False),
        Column("created_at", Float, nullable=False),
    )
    md.create_all(conn, checkfirst=True)


def _posted_rewards(conn: Connection) -> None:
    md = MetaData()
    Table("attempts", md, Column("id", String(40), primary_key=True))
    Table(
        "posted_rewards",
        md,
        Column("attempt_id", String(40), ForeignKey("attempts.id"), primary_key=True),
        Column("reward", Float, nullable=False),
        Column("info", JSON, nullable=False),
        Column("posted_at", Float, nullable=False),
        Column("posts", Integer, nullable=False),
    ).create(conn, checkfirst=True)


def _add_call_column(name: str, kind: Callable[[], TypeEngine[Any]]) -> Callable[[Connection], None]:
    """A nullable column added to `calls`, unless a store from before the migration list has it."""

    def apply(conn: Connection) -> None:
        if name not in {c["name"] for c in inspect(conn).get_columns("calls")}:
            column = Table("calls", MetaData(), Column(name, kind())).c[name]
            ddl = CreateColumn(column).compile(dialect=conn.dialect)
            conn.execute(text(f"ALTER TABLE calls ADD COLUMN {ddl}"))

    return apply


def _counters(conn: Connection) -> None:
    """Counters that continue the store's sequences (see tables.counters)."""
    counters = Table(
        "counters",
        MetaData(),
        Column("name", String(32), primary_key=True),
        Column("value", BigInteger, nullable=False),
    )
    counters.create(conn)
    start = {
        name: conn.scalar(text(f"SELECT COALESCE(MAX({name}), 0) FROM rollouts"))
        for name in ("finish_seq", "created_seq")
    }
    conn.execute(insert(counters), [{"name": name, "value": value} for name, value in start.items()])


def _shared_serving(conn: Connection) -> None:
    """What every gateway process must agree on: the serving pause, the live processes, the progress board."""
    md = MetaData()
    serving = Table(
        "serving",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("paused", Boolean, nullable=False),
        Column("resumes_at", Float),
        Column("generation", BigInteger, nullable=False),
    )
    Table(
        "gateway_workers",
        md,
        Column("id", String(40), primary_key=True),
        Column("host", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("seen_at", Float, nullable=False),
        Column("generation", BigInteger, nullable=False),
        Column("in_flight", Integer, nullable=False),
        Column("held", Integer, nullable=False),
    )
    Table(
        "progress",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("board", JSON, nullable=False),
    )
    md.create_all(conn)
    conn.execute(insert(serving).values(id=1, paused=False, resumes_at=None, generation=0))


def _claim_key(conn: Connection) -> None:
    """attempts.claim_key and its index: a claim whose answer was lost can be repeated (tables.attempts)."""
    conn.execute(text("ALTER TABLE attempts ADD COLUMN claim_key VARCHAR(64)"))
    conn.execute(text("CREATE INDEX ix_attempts_claim_key ON attempts (claim_key)"))


def _body_columns(conn: Connection) -> None:
    """A continuation's request body stored as the items its conversation list adds (tables.calls)."""
    _add_call_column("body_prefix", Integer)(conn)
    _add_call_column("body_items", Integer)(conn)
    _add_call_column("body_digest", lambda: String(32))(conn)


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "rollouts, attempts, calls, model_versions", _first_tables),
    Migration(2, "posted_rewards", _posted_rewards),
    Migration(3, "calls.notes", _add_call_column("notes", JSON)),
    Migration(4, "calls.turns_digest", _add_call_column("turns_digest", lambda: String(32))),
    Migration(5, "counters of finish_seq and created_seq", _counters),
    Migration(
        6,
        "calls.prompt_prefix: a continuation stores its new prompt ids only",
        _add_call_column("prompt_prefix", Integer),
    ),
    Migration(
        7, "serving, gateway_workers, progress: state shared by every gateway process", _shared_serving
    ),
    Migration(
        8,
        "calls.body_prefix, body_items, body_digest: a continuation stores the request body's new items only",
        _body_columns,
    ),
    Migration(
        9, "attempts.claim_key: a claim repeated after its answer was lost is answered again", _claim_key
    ),
)
LATEST = MIGRATIONS[-1].version
assert [m.version for m in MIGRATIONS] == list(range(1, LATEST + 1)), "versions run 1, 2, 3, ... in order"


def migrate(conn: Connection) -> list[int]:
    """Bring the store to LATEST inside the caller's transaction; returns the versions applied.
    On PostgreSQL the transaction first takes an advisory lock (released at its end), so concurrent
    openers migrate one after the other; on SQLite the caller's transaction is BEGIN IMMEDIATE."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(_LOCK_KEY)))
    schema_version.create(conn, checkfirst=True)
    current = conn.scalar(select(func.coalesce(func.max(schema_version.c.version), 0))) or 0
    if current > LATEST:
        raise SchemaTooNew(
            f"the store is at schema version {current}, newer than this gateway knows ({LATEST}): "
            "run a gateway at least as new as the one that last opened it"
        )
    applied = []
    for migration in MIGRATIONS[current:]:
        migration.apply(conn)
        conn.execute(
            insert(schema_version).values(
                version=migration.version, name=migration.name, applied_at=time.time()
            )
        )
        applied.append(migration.version)
    return applied
