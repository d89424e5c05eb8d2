"""Several gateway processes on one real PostgreSQL 15 database: two `Store`s (as two processes hold
them) claiming, expiring, completing and exporting at once, and two real gateway servers started together
on one database that a harness conversation crosses. The single-process store behaviour runs on both
backends in test_store.py."""

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ADMIN
from gwhelpers import admin, calls_of, harness_client, run_conversation
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from testsupport import Server, free_port

from inharness.demo import QUESTION
from inharness.gateway import schema
from inharness.gateway.store import Store
from inharness.gateway.store.store import store_url

ROLLOUTS = 60


async def _two_stores(url: str) -> tuple[Store, Store]:
    """Two stores opened at once on one new database: both migrate it, one after the other."""
    a, b = await asyncio.gather(Store.open(url), Store.open(url))
    return a, b


async def test_two_stores_claim_each_rollout_once_and_number_finishes_uniquely_in_commit_order(
    postgres_url: str,
) -> None:
    a, b = await _two_stores(postgres_url)
    try:
        await a.create_rollouts(schema.CreateRollouts(tasks=list(range(ROLLOUTS))), default_max_attempts=1)
        # Each asks for more than half: SKIP LOCKED hands the rest to the other, never one rollout twice.
        first, second = await asyncio.gather(
            a.claim_many("default", 600, 40), b.claim_many("default", 600, 40)
        )
        claimed = first + second
        assert len(claimed) == ROLLOUTS
        assert len({c.rollout_id for c in claimed}) == ROLLOUTS and len({c.id for c in claimed}) == ROLLOUTS
        assert await a.claim("default", 600) is None and await b.claim("default", 600) is None

        done = asyncio.Event()
        exported: list[schema.ExportedRollout] = []

        async def follow_export() -> None:
            """Resume from the last cursor seen, as the trainer does, while rollouts finish."""
            cursor = 0
            for _ in range(100_000):
                finished_before = done.is_set()
                page = await b.export(after=cursor, limit=7, bodies=False)
                exported.extend(page)
                cursor = page[-1].cursor if page else cursor
                if finished_before and not page:
                    return
            pytest.fail("the export did not drain")

        async def finish_all() -> None:
            # Completions through both stores at once, alternating; the last third race the lease sweep.
            completions = [
                (a if i % 2 else b).complete(c.id, schema.CompleteRequest(status="succeeded", reward=1.0))
                for i, c in enumerate(claimed[: 2 * ROLLOUTS // 3])
            ]
            await asyncio.gather(*completions)
            done.set()

        follower = asyncio.create_task(follow_export())
        await finish_all()
        late = claimed[2 * ROLLOUTS // 3 :]
        # Both processes' sweeps run at once on leases that have (as far as they know) passed.
        far = max(c.lease_expires_at for c in late) + 1
        expired = await asyncio.gather(a.expire_leases(far), b.expire_leases(far))
        assert sum(expired) == len(late)  # each attempt expired by exactly one sweep
        await follower

        tail = await a.export(after=exported[-1].cursor if exported else 0, limit=1000, bodies=False)
        everything = exported + tail
        cursors = [e.cursor for e in everything]
        assert cursors == list(range(1, ROLLOUTS + 1))  # unique, gap-free, in the order they were read
        assert sorted(e.rollout.id for e in everything) == sorted(c.rollout_id for c in claimed)
        assert {e.rollout.status for e in everything[: 2 * ROLLOUTS // 3]} == {"succeeded"}
        assert {e.rollout.status for e in tail} <= {"failed"}
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_two_stores_completing_one_attempt_at_once_settle_it_once(
    postgres_url: str,
) -> None:
    a, b = await _two_stores(postgres_url)
    try:
        await a.create_rollouts(schema.CreateRollouts(tasks=list(range(20))), default_max_attempts=2)
        attempts = await a.claim_many("default", 600, 20)
        outcomes = await asyncio.gather(
            *(
                store.complete(att.id, schema.CompleteRequest(status="failed"))
                for att in attempts
                for store in (a, b)
            ),
            return_exceptions=True,
        )
        # Per attempt: one completion lands; the other, identical, is answered as its duplicate.
        for first, second in zip(outcomes[::2], outcomes[1::2], strict=True):
            assert sorted([first[1], second[1]]) == [False, True]  # type: ignore[index]
        rollouts = await b.get_rollouts([att.rollout_id for att in attempts])
        assert [(r.status, len(r.attempts)) for r in rollouts] == [("queued", 1)] * 20  # requeued once each
        assert await b.count_rollouts("queued") == 20
    finally:
        await asyncio.gather(a.close(), b.close())


# --- two real gateways on one database ------------------------------------------------------------------


def _gateway(model: Path, engine: Server, log_dir: Path, store: str, *, by_env: bool) -> Server:
    """`inharness gateway` on the database: by flag, or by env var as the operator passes it."""
    port = free_port()
    args = ["gateway", "--model", str(model), "--engine", engine.url, "--port", str(port)]
    args += [f"--admin-token={ADMIN}"]
    env = {"INHARNESS_GATEWAY_STORE": store} if by_env else {}
    if not by_env:
        args += ["--store", store]
    argv = [sys.executable, "-m", "inharness.cli", *args]
    return Server(argv, port=port, log=log_dir / f"gateway-pg-{port}.log", health="/healthz", env=env)


@pytest.fixture(scope="module")
def gateways(
    engine: Server, tool_model: Path, log_dir: Path, postgres: Any
) -> Iterator[tuple[Server, Server, str]]:
    """Two gateways started together on one new database (its URL third): both migrate it and register
    the engine."""
    url = postgres.create_database()
    pair = (
        _gateway(tool_model, engine, log_dir, url, by_env=False),
        _gateway(tool_model, engine, log_dir, url, by_env=True),
    )
    for gw in pair:
        gw.spawn()
    try:
        for gw in pair:
            gw.wait_healthy()
        yield (*pair, url)
    finally:
        for gw in pair:
            gw.stop()


def _stored_prompts(url: str) -> dict[int, tuple[int, int | None]]:
    """Per call id: (ids stored for its prompt, its prompt_prefix), as the database holds them."""

    async def read() -> dict[int, tuple[int, int | None]]:
        engine = create_async_engine(store_url(url))
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(text("SELECT id, length(prompt_ids) / 4, prompt_prefix FROM calls"))
                return {r[0]: (r[1], r[2]) for r in rows}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_a_conversation_crosses_two_gateways_on_one_database_and_exports_once(
    gateways: tuple[Server, Server, str],
) -> None:
    a, b, url = gateways
    with admin(a) as ca, admin(b) as cb:
        assert ca.post("/api/v1/rollouts", json={"tasks": [{"question": QUESTION}] * 2}).status_code == 201
        r1 = ca.post("/api/v1/attempts/claim", json={"pool": "default", "lease_seconds": 600})
        r2 = cb.post("/api/v1/attempts/claim", json={"pool": "default", "lease_seconds": 600})
        first, second = r1.json()["attempt"], r2.json()["attempt"]
        assert first["rollout_id"] != second["rollout_id"]
        assert cb.post("/api/v1/attempts/claim", json={"pool": "default"}).status_code == 204  # none left

        # Claimed through a, called through b: the key and the recorded calls live in the database.
        run_conversation(harness_client(b, first["token"]))
        c1, c2 = calls_of(a, first["id"])
        assert c2["parent_call_id"] == c1["id"] and c2["prefix_reused"]
        assert c2["prompt_ids"][: len(c1["prompt_ids"]) + len(c1["response_ids"])] == (
            c1["prompt_ids"] + c1["response_ids"]
        )
        # The continuation is stored as its new ids only; the reads above gave its whole prompt.
        extends = len(c1["prompt_ids"]) + len(c1["response_ids"])
        stored = _stored_prompts(url)
        assert stored[c1["id"]] == (len(c1["prompt_ids"]), None)
        assert stored[c2["id"]] == (len(c2["prompt_ids"]) - extends, extends)

        done = {"status": "succeeded", "reward": 1.0}
        assert cb.post(f"/api/v1/attempts/{first['id']}/complete", json=done).status_code == 200
        assert ca.post(f"/api/v1/attempts/{second['id']}/complete", json=done).status_code == 200
        lines = [json.loads(line) for line in cb.get("/api/v1/export/rollouts").text.splitlines()]
        assert [line["cursor"] for line in lines] == [1, 2]
        assert [line["rollout"]["id"] for line in lines] == [first["rollout_id"], second["rollout_id"]]
        assert [c["id"] for c in lines[0]["calls"]] == [c1["id"], c2["id"]]
        versions = ca.get("/api/v1/models/versions").json()  # both registered it; one row, active
        assert [(v["version"], v["active"]) for v in versions["versions"]] == [(0, True)]
