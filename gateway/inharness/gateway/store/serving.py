"""Model versions (the engines serving each, the active one) and the state the gateway's processes
share through the store: the serving pause, each worker's last report, the progress board.
"""

import time
from typing import Any

from sqlalchemy import (
    delete,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from inharness.gateway import schema
from inharness.gateway.store.base import (
    NotFound,
    SharedServing,
    StoreCore,
    WorkerReport,
)
from inharness.gateway.store.tables import (
    gateway_workers,
    model_versions,
    progress,
    serving,
)


class ServingStore(StoreCore):
    """The model versions and shared serving state part of `Store`."""

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


def _version_out(r: Any) -> schema.ModelVersionOut:
    return schema.ModelVersionOut(
        version=r.version, engines=r.engines, active=r.active, created_at=r.created_at
    )


async def _activate(conn: AsyncConnection, version: int) -> None:
    await conn.execute(update(model_versions).values(active=model_versions.c.version == version))
