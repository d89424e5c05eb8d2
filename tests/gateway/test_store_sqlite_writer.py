"""SQLite's call writer runs its three statements as plain SQL on the sqlite3 connection (`_SqliteCalls`)
instead of through SQLAlchemy Core (`_CoreCalls`, PostgreSQL's): the same records written both ways
into two copies of one store give the same rows, value for value as SQLite quotes them, and the same
answers for attempts that no longer run."""

import asyncio
import shutil
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

from sqlalchemy import create_engine
from test_store import _record as store_record

from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Store
from inharness.gateway.store.calls import _CoreCalls, _insert_calls, _SqliteCalls
from inharness.gateway.store.tables import calls


def _record(attempt: schema.ClaimedAttempt, n: int, **changes: object) -> CallRecord:
    body = {"model": "m", "messages": [{"role": "user", "content": "2+3?"}]}
    answer = {"id": f"c{n}", "choices": [{"message": {"content": "5", "refusal": None}}]}
    return replace(store_record(attempt, n), **{"request_body": body, "response_body": answer, **changes})


def _claimed(db: Path) -> schema.ClaimedAttempt:
    async def main() -> schema.ClaimedAttempt:
        store = await Store.open(f"sqlite:///{db}")
        try:
            await store.create_rollouts(schema.CreateRollouts(tasks=[1]), default_max_attempts=2)
            claimed = await store.claim("default", 600)
            assert claimed is not None
            return claimed
        finally:
            await store.close()

    return asyncio.run(main())


def _quoted_rows(db: Path) -> list[tuple[str, ...]]:
    columns = ", ".join(f"quote({c.name})" for c in calls.columns)
    with sqlite3.connect(db) as conn:
        return conn.execute(f"SELECT {columns} FROM calls ORDER BY id").fetchall()


def test_plain_sql_writes_the_rows_sqlalchemy_writes(tmp_path: Path) -> None:
    core_db, plain_db = tmp_path / "core.db", tmp_path / "plain.db"
    attempt = _claimed(core_db)
    shutil.copy(core_db, plain_db)
    gone = schema.ClaimedAttempt.model_validate({**attempt.model_dump(), "id": "att-gone"})
    root = _record(attempt, 1, first_token_at=time.time(), notes=("a tool type the model cannot run",))
    batches = [
        ([root, _record(gone, 2)], "full"),
        (
            [
                _record(
                    attempt,
                    3,
                    parent_call_id=1,
                    prefix_reused=True,
                    prompt_ids=[1, 2, 1, 7, 1, 9, 9],
                    request_body={
                        "model": "m",
                        "messages": [
                            {"role": "user", "content": "2+3?"},
                            {"role": "assistant", "content": "5"},
                            {"role": "user", "content": "and 1.0 times true?", "x": [1, 1.0, True, None]},
                        ],
                    },
                    turns_digest="t3",
                )
            ],
            "full",
        ),
        ([_record(attempt, 4, parent_call_id=3, prefix_reused=True, prompt_ids=[5])], "none"),
    ]
    answers = {}
    for db, ops in ((core_db, _CoreCalls), (plain_db, None)):
        engine = create_engine(f"sqlite:///{db}")
        got = []
        for records, bodies in batches:
            with engine.begin() as conn:
                writer = ops(conn) if ops is not None else _SqliteCalls(conn.connection.driver_connection)
                got.append(_insert_calls(writer, [replace(r) for r in records], bodies))  # type: ignore[arg-type]
        engine.dispose()
        answers[db.name] = got
    assert answers["core.db"] == answers["plain.db"] == [[1, None], [2], [3]]
    core, plain = _quoted_rows(core_db), _quoted_rows(plain_db)
    assert len(core) == 3
    assert core == plain
