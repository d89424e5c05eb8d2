"""The store's rollout queue on a real SQLite file: leases, requeues, stale completions, export."""

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
    import asyncio

    await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    a = await store.claim("default", 60)
    records = [_record(a, n) for n in range(50)]
    await asyncio.gather(*(store.record_calls([r]) for r in records))
    assert sorted(r.id for r in records) == list(range(1, 51))
    stored = await store.list_calls(a.id)
    assert [c.request["n"] for c in stored] == list(range(50))
