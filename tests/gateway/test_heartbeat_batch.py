"""Renewing many leases in one request (`POST /api/v1/attempts/heartbeat-batch`): the store's
`heartbeat_many` on a real SQLite file and a real PostgreSQL 15 server, and the route on a real
gateway on 127.0.0.1. Each id is answered renewed, finished, expired or unknown, in the request's
order; the batch is bounded in size and in the statements it costs; only the admin token may renew."""

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ADMIN
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from sqlalchemy import event
from testsupport import Server, gateway_server

from inharness.gateway import schema
from inharness.gateway.client import GatewayClient
from inharness.gateway.store import Store


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'gw.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    s = await Store.open(url)
    yield s
    await s.close()


async def _claim(
    store: Store, n: int, lease_seconds: float, pool: str = "default"
) -> list[schema.ClaimedAttempt]:
    await store.create_rollouts(
        schema.CreateRollouts(tasks=list(range(n)), pool=pool, max_attempts=1), default_max_attempts=1
    )
    return await store.claim_many(pool, lease_seconds, n)


async def test_heartbeat_many_renews_live_leases_and_says_why_the_others_were_not(store: Store) -> None:
    live, done, released, untouched = await _claim(store, 4, 60)
    await store.complete(done.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    await store.complete(released.id, schema.CompleteRequest(status="released"))
    [gone] = await _claim(store, 1, -1, pool="gone")  # its lease passed at once
    assert await store.expire_leases() == 1  # and the store expired it
    before = time.time()
    ids = [live.id, done.id, "at-nonexistent", released.id, live.id, gone.id]
    out = await store.heartbeat_many(ids, 120)

    assert [r.id for r in out] == ids, "one answer per id, in the request's order"
    got = {r.id: (r.lease, r.status) for r in out}
    assert got == {
        live.id: ("renewed", "running"),
        done.id: ("finished", "succeeded"),
        "at-nonexistent": ("unknown", None),
        released.id: ("finished", "released"),
        gone.id: ("expired", "failed"),
    }
    assert out[0].lease_expires_at is not None and out[0].lease_expires_at >= before + 120
    assert out[2].lease_expires_at is None
    # The renewal is stored; the others are left as they were.
    rollout = await store.get_rollout(live.rollout_id)
    assert rollout.attempts[0].lease_expires_at == out[0].lease_expires_at
    stored = (await store.get_rollout(untouched.rollout_id)).attempts[0]
    assert stored.lease_expires_at == untouched.lease_expires_at, "an attempt not named is not renewed"


async def test_heartbeat_many_without_a_lease_renews_each_by_its_claimed_lease(store: Store) -> None:
    [short] = await _claim(store, 1, 30, pool="short")
    [long] = await _claim(store, 1, 900, pool="long")
    before = time.time()
    out = await store.heartbeat_many([short.id, long.id], None)
    assert [r.lease for r in out] == ["renewed", "renewed"]
    assert before + 30 <= (out[0].lease_expires_at or 0) < before + 900 <= (out[1].lease_expires_at or 0)


async def test_a_running_attempt_whose_lease_passed_is_expired_not_renewed(store: Store) -> None:
    [lapsing] = await _claim(store, 1, -0.5)  # not yet expired by expire_leases: still "running"
    [out] = await store.heartbeat_many([lapsing.id], 60)
    assert (out.lease, out.status) == ("expired", "running")
    stored = (await store.get_rollout(lapsing.rollout_id)).attempts[0]
    assert stored.lease_expires_at == lapsing.lease_expires_at


async def test_heartbeat_many_costs_a_few_statements_however_many_ids(store: Store) -> None:
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement.split()[0].upper())

    attempts = await _claim(store, 1000, 60)
    event.listen(store._engine.sync_engine, "before_cursor_execute", seen)
    try:
        out = await store.heartbeat_many([a.id for a in attempts], 60)
        all_renewed = list(statements)
        statements.clear()
        await store.complete(attempts[0].id, schema.CompleteRequest(status="failed"))
        statements.clear()
        mixed = await store.heartbeat_many([a.id for a in attempts], 60)
    finally:
        event.remove(store._engine.sync_engine, "before_cursor_execute", seen)
    assert all(r.lease == "renewed" for r in out)
    # 1,000 ids: two UPDATE ... RETURNING of 500, and no SELECT when every lease was renewed
    assert all_renewed == ["UPDATE", "UPDATE"]
    assert [r.lease for r in mixed].count("finished") == 1
    assert statements == ["UPDATE", "SELECT", "UPDATE"], "a SELECT only for the chunk with a lost lease"


# --- the route ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("heartbeat-batch") / "gateway.db"
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


async def test_the_route_answers_each_id_renewed_finished_expired_or_unknown(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        await gw.create_rollouts([1, 2, 3], pool="hb-route", max_attempts=1)
        live, done, _ = await gw.claim_batch("hb-route", 60, limit=3)
        await gw.complete(done.id, "failed", info={"reason": "boom"})
        await gw.create_rollouts([4], pool="hb-lapse")
        lapsing = await gw.claim("hb-lapse", 0.001)
        assert lapsing is not None
        await asyncio.sleep(0.01)  # its 1 ms lease passes
        out = await gw.heartbeat_batch([lapsing.id, live.id, done.id, "at-missing"], 300)
        rollout = await gw.get_rollout(live.rollout_id)

    assert [(r.id, r.lease, r.status) for r in out] == [
        (lapsing.id, "expired", "running"),
        (live.id, "renewed", "running"),
        (done.id, "finished", "failed"),
        ("at-missing", "unknown", None),
    ]
    assert rollout.attempts[0].lease_expires_at == out[1].lease_expires_at > live.lease_expires_at


async def test_the_route_bounds_the_batch_and_answers_in_the_protocols_error_format(gateway: Server) -> None:
    url = f"{gateway.url}/api/v1/attempts/heartbeat-batch"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(timeout=30) as h:
        at_most = await h.post(url, json={"attempt_ids": ["at-x"] * schema.MAX_HEARTBEAT_BATCH}, headers=auth)
        over = await h.post(
            url, json={"attempt_ids": ["at-x"] * (schema.MAX_HEARTBEAT_BATCH + 1)}, headers=auth
        )
        empty = await h.post(url, json={"attempt_ids": []}, headers=auth)
    assert at_most.status_code == 200, at_most.text
    assert len(at_most.json()["attempts"]) == schema.MAX_HEARTBEAT_BATCH
    for r in (over, empty):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "attempt_ids",
            "invalid_value",
        )


async def test_the_route_takes_the_admin_token_only(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        await gw.create_rollouts([1], pool="hb-auth")
        attempt = await gw.claim("hb-auth", 60)
        assert attempt is not None
    url = f"{gateway.url}/api/v1/attempts/heartbeat-batch"
    body = {"attempt_ids": [attempt.id]}
    async with httpx.AsyncClient(timeout=30) as h:
        answers = [
            await h.post(url, json=body),
            await h.post(url, json=body, headers={"Authorization": f"Bearer {attempt.token}"}),
            await h.post(url, json=body, headers={"Authorization": "Bearer wrong"}),
        ]
        admin = await h.post(url, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    for r in answers:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", r.text
    assert admin.status_code == 200 and admin.json()["attempts"][0]["lease"] == "renewed"
