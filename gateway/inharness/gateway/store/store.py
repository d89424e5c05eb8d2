"""The gateway's durable store: rollout queue with leases, attempts, recorded calls, model versions.

SQLAlchemy 2 async Core over SQLite (embedded default, WAL; aiosqlite) or PostgreSQL (asyncpg), the same
queries on both; the schema is brought up to date on open (migrations.py). `Store` is one face over
its concerns, each a module with the SQL of both backends side by side: the rollout queue and its
attempts (queue.py, with what keeps several gateway processes on one PostgreSQL correct), recorded
calls and the export (calls.py, with the group-commit writer and how a continuation is stored), model
versions and the state the gateway's processes share (serving.py); base.py holds what they share.
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from sqlalchemy import (
    URL,
    Engine,
    create_engine,
    event,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from inharness.gateway.store.base import (
    Bodies,
    CallRecord,
    StoreError,
)
from inharness.gateway.store.calls import CallStore
from inharness.gateway.store.migrations import migrate
from inharness.gateway.store.queue import QueueStore
from inharness.gateway.store.serving import ServingStore

SqliteSync = Literal["off", "normal", "full"]


class Store(QueueStore, CallStore, ServingStore):
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
