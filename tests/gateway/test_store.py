"""The store's rollout queue on a real SQLite file: leases, requeues, stale completions, export."""

import asyncio
import time
from pathlib import Path

import pytest

from inharness.gateway import schema
from inharness.gateway.store import CallRecord, Conflict, Store


@pytest.fixture
async def store(tmp_path: Path) -> Store:
    s = await Store.open(f"sqlite:///{tmp_path / 'gw.db'}")
    yield s
    await s.close()


def _record(attempt: schema.ClaimedAttempt, n: int) -> CallRecord:
    now = time.time()
    return CallRecord(
        attempt_id=attempt.id,
        rollout_id=attempt.rollout_id,
        request_id=f"r{n}",
        choice_index=0,
        protocol="openai.chat",
        requested_model="m",
        model_version=0,
        engine="e",
        prompt_ids=[1, 2, n],
        response_ids=[7, n],
        response_logprobs=[-0.5, -1.0],
        finish_reason="stop",
        parent_call_id=None,
        prefix_reused=False,
        prefix_mismatch=None,
        request_digest=f"q{n}",
        reply_digest=f"a{n}",
        started_at=now,
        first_token_at=None,
        finished_at=now,
        request_body={"n": n},
        response_body={},
    )


async def test_group_size_makes_rollouts_per_task_sharing_a_group(store: Store) -> None:
    ids = await store.create_rollouts(
        schema.CreateRollouts(tasks=[{"q": 1}, {"q": 2}], group_size=3), default_max_attempts=2
    )
    rollouts = await store.get_rollouts(ids)
    assert len(rollouts) == 6 and all(r.status == "queued" for r in rollouts)
    assert len({r.group_id for r in rollouts}) == 2
    assert [r.task for r in rollouts] == [{"q": 1}] * 3 + [{"q": 2}] * 3


async def test_claims_are_fifo_and_none_when_empty(store: Store) -> None:
    ids = await store.create_rollouts(schema.CreateRollouts(tasks=["a", "b"]), default_max_attempts=1)
    first = await store.claim("default", 60)
    second = await store.claim("default", 60)
    assert (first.rollout_id, second.rollout_id) == tuple(ids)
    assert await store.claim("default", 60) is None
    assert await store.claim("other-pool", 60) is None


async def test_expired_lease_requeues_as_a_new_attempt_up_to_the_limit(store: Store) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=2)
    a1 = await store.claim("default", 0.01)
    assert await store.expire_leases(time.time() + 1) == 1
    ro = await store.get_rollout(rid)
    assert ro.status == "queued" and ro.attempts[0].failure_reason == "lease expired"
    a2 = await store.claim("default", 0.01)
    assert a2.seq == 2 and a2.id != a1.id
    await store.expire_leases(time.time() + 1)
    ro = await store.get_rollout(rid)
    assert ro.status == "failed" and [a.status for a in ro.attempts] == ["failed", "failed"]
    assert await store.claim("default", 60) is None


async def test_stale_completion_is_refused_and_changes_nothing(store: Store) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=3)
    stale = await store.claim("default", 0.01)
    await store.expire_leases(time.time() + 1)
    fresh = await store.claim("default", 60)
    before = await store.get_rollout(rid)
    with pytest.raises(Conflict, match="expired"):
        await store.complete(stale.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    assert await store.get_rollout(rid) == before
    out, dup = await store.complete(fresh.id, schema.CompleteRequest(status="succeeded", reward=0.5))
    assert not dup and out.reward == 0.5
    assert (await store.get_rollout(rid)).reward == 0.5


async def test_repeated_completion_is_idempotent_and_a_different_one_conflicts(store: Store) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    a = await store.claim("default", 60)
    done = schema.CompleteRequest(status="succeeded", reward=1.0)
    _, dup1 = await store.complete(a.id, done)
    _, dup2 = await store.complete(a.id, done)
    assert (dup1, dup2) == (False, True)
    with pytest.raises(Conflict):
        await store.complete(a.id, schema.CompleteRequest(status="failed"))


async def test_export_resumes_from_cursor_without_repeats_or_gaps(store: Store) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=list(range(5))), default_max_attempts=1)
    for n in range(5):
        a = await store.claim("default", 60)
        await store.record_calls([_record(a, n)])
        await store.complete(a.id, schema.CompleteRequest(status="succeeded", reward=float(n)))
    page1 = await store.export(after=0, limit=2, bodies=False)
    page2 = await store.export(after=page1[-1].cursor, limit=10, bodies=False)
    tasks = [e.rollout.task for e in page1 + page2]
    assert tasks == [0, 1, 2, 3, 4]
    assert page2[0].calls[0].prompt_ids == [1, 2, 2] and page2[0].calls[0].response_logprobs == [-0.5, -1.0]
    assert page2[0].calls[0].request is None


async def test_concurrent_call_records_share_commits_and_all_land(store: Store) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    a = await store.claim("default", 60)
    records = [_record(a, n) for n in range(50)]
    await asyncio.gather(*(store.record_calls([r]) for r in records))
    assert sorted(r.id for r in records) == list(range(1, 51))
    stored = await store.list_calls(a.id)
    assert [c.request["n"] for c in stored] == list(range(50))


# --- released attempts ----------------------------------------------------------------------------------


def _released(reason: str | None = None) -> schema.CompleteRequest:
    return schema.CompleteRequest(status="released", info={"reason": reason} if reason else {})


async def test_released_attempts_are_not_charged_and_the_rollout_fails_only_at_its_limit(
    store: Store,
) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    for _ in range(2):
        a = await store.claim("default", 60)
        out, dup = await store.complete(a.id, _released())
        assert not dup and (out.status, out.failure_reason) == ("released", "released by runner")
        assert (await store.get_rollout(rid)).status == "queued"
    last = await store.claim("default", 60)
    assert last.seq == 3  # numbering keeps counting; only the charge skips released attempts
    await store.complete(last.id, schema.CompleteRequest(status="failed"))
    ro = await store.get_rollout(rid)
    assert ro.status == "failed" and [a.status for a in ro.attempts] == ["released", "released", "failed"]
    assert await store.claim("default", 60) is None


async def test_a_failure_after_releases_requeues_while_charged_attempts_remain(store: Store) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=2)
    for _ in range(2):
        await store.complete((await store.claim("default", 60)).id, _released())
    await store.complete((await store.claim("default", 60)).id, schema.CompleteRequest(status="failed"))
    assert (await store.get_rollout(rid)).status == "queued"  # three started, one charged of two
    await store.complete((await store.claim("default", 60)).id, schema.CompleteRequest(status="failed"))
    ro = await store.get_rollout(rid)
    assert ro.status == "failed" and [a.status for a in ro.attempts] == ["released"] * 2 + ["failed"] * 2


async def test_a_released_rollout_is_claimable_at_once_and_keeps_the_given_reason(store: Store) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    first = await store.claim("default", 600)
    out, _ = await store.complete(first.id, _released("engine down"))
    assert out.failure_reason == "engine down"
    again = await store.claim("default", 600)
    assert again is not None and (again.rollout_id, again.seq) == (rid, 2)


async def test_a_repeated_release_is_idempotent_and_a_different_completion_conflicts(store: Store) -> None:
    (rid,) = await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    a = await store.claim("default", 60)
    _, dup1 = await store.complete(a.id, _released())
    _, dup2 = await store.complete(a.id, _released())
    assert (dup1, dup2) == (False, True)
    with pytest.raises(Conflict):
        await store.complete(a.id, schema.CompleteRequest(status="failed"))
    ro = await store.get_rollout(rid)
    assert ro.status == "queued" and [x.status for x in ro.attempts] == ["released"]


async def test_release_running_releases_only_that_pools_running_attempts_expired_included(
    store: Store,
) -> None:
    mine = await store.create_rollouts(
        schema.CreateRollouts(tasks=["a", "b", "c"], pool="mine"), default_max_attempts=1
    )
    (theirs,) = await store.create_rollouts(
        schema.CreateRollouts(tasks=["x"], pool="theirs"), default_max_attempts=1
    )
    live = await store.claim("mine", 600)
    expired = await store.claim("mine", 0.01)
    done = await store.claim("mine", 600)
    await store.complete(done.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    other = await store.claim("theirs", 600)
    await asyncio.sleep(0.02)  # the second lease has passed, and nothing expired it yet

    released = await store.release_running("mine", "runner restarted")

    assert sorted(released) == sorted([live.id, expired.id])
    by_id = {r.id: r for r in await store.get_rollouts(mine)}
    for a in (live, expired):
        ro = by_id[a.rollout_id]
        assert ro.status == "queued"
        assert (ro.attempts[0].status, ro.attempts[0].failure_reason) == ("released", "runner restarted")
    assert by_id[done.rollout_id].status == "succeeded"
    assert (await store.get_rollout(theirs)).attempts[0].status == "running" and other.rollout_id == theirs
    assert await store.release_running("mine", "again") == []
    again = await store.claim_many("mine", 600, 10)  # max_attempts 1, yet both are claimable again
    assert sorted(a.rollout_id for a in again) == sorted([live.rollout_id, expired.rollout_id])


# --- completion answer: recorded calls ------------------------------------------------------------------


async def test_the_completion_answer_counts_the_attempts_recorded_calls(store: Store) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=["a", "b"]), default_max_attempts=1)
    silent, busy = await store.claim("default", 60), await store.claim("default", 60)
    await store.record_calls([_record(busy, 0), _record(busy, 1)])
    await store.record_calls([_record(busy, 2)])
    out, _ = await store.complete(silent.id, schema.CompleteRequest(status="failed"))
    assert out.calls == 0
    out, _ = await store.complete(busy.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    assert out.calls == 3
    out, dup = await store.complete(busy.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    assert dup and out.calls == 3
    assert (await store.heartbeat((await _fresh(store)).id, None)).calls is None  # only in the answer


async def _fresh(store: Store) -> schema.ClaimedAttempt:
    await store.create_rollouts(schema.CreateRollouts(tasks=["c"]), default_max_attempts=1)
    a = await store.claim("default", 60)
    assert a is not None
    return a


# --- held rollouts --------------------------------------------------------------------------------------


async def test_a_held_rollout_is_not_claimed_and_an_unheld_one_is(store: Store) -> None:
    early, late = await store.create_rollouts(
        schema.CreateRollouts(tasks=["v1", "v2"]), default_max_attempts=1
    )
    assert await store.hold([late]) == 1
    assert (await store.get_rollout(late)).status == "held"
    assert (await store.claim("default", 60)).rollout_id == early
    assert await store.claim("default", 60) is None
    assert await store.count_rollouts("held") == 1 and await store.count_rollouts("queued") == 0
    assert await store.unhold([late, late]) == 1
    assert (await store.claim("default", 60)).rollout_id == late


async def test_hold_and_unhold_change_only_rollouts_in_the_state_they_leave(store: Store) -> None:
    running, finished, queued = await store.create_rollouts(
        schema.CreateRollouts(tasks=["r", "f", "q"]), default_max_attempts=1
    )
    await store.claim("default", 60)
    done = await store.claim("default", 60)
    await store.complete(done.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    assert await store.hold([running, finished, queued, "ro-unknown"]) == 1
    assert await store.hold([queued]) == 0  # already held
    assert await store.unhold([running, finished]) == 0
    statuses = [r.status for r in await store.get_rollouts([running, finished, queued])]
    assert statuses == ["running", "succeeded", "held"]
    assert [e.rollout.id for e in await store.export(after=0, limit=10, bodies=False)] == [finished]


async def test_hold_takes_more_ids_than_one_statement_binds(store: Store) -> None:
    ids = await store.create_rollouts(schema.CreateRollouts(tasks=list(range(1200))), default_max_attempts=1)
    assert await store.hold(ids) == 1200
    assert await store.claim("default", 60) is None
    assert await store.unhold(ids) == 1200 and await store.count_rollouts("queued") == 1200


async def test_a_store_made_before_the_notes_column_gains_it(tmp_path: Path) -> None:
    import sqlite3

    from sqlalchemy import create_engine

    from inharness.gateway.store.tables import metadata

    db = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{db}")
    metadata.create_all(engine)
    engine.dispose()
    with sqlite3.connect(db) as conn:  # the calls table as the first stores had it
        conn.execute("ALTER TABLE calls DROP COLUMN notes")
    store = await Store.open(f"sqlite:///{db}")
    try:
        await store.create_rollouts(schema.CreateRollouts(tasks=["a"]), default_max_attempts=1)
        attempt = await store.claim("default", 60)
        assert attempt is not None
        noted = _record(attempt, 1)
        noted.notes = ["tools[1] of type 'web_search' is left out of the prompt"]
        await store.record_calls([_record(attempt, 0), noted])
        assert [c.notes for c in await store.list_calls(attempt.id)] == [[], noted.notes]
    finally:
        await store.close()
