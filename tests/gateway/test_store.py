"""The store's rollout queue on a real SQLite file and on a real PostgreSQL 15 server: leases, requeues,
stale completions, export; and its migrations: a new store, and stores made before the migration list."""

import asyncio
import itertools
import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from postgres_server import postgres_fixture, postgres_url_fixture  # noqa: F401 (the fixtures)
from pydantic import ValidationError
from sqlalchemy import Connection, insert, inspect, text
from sqlalchemy.ext.asyncio import create_async_engine

from inharness.gateway import schema
from inharness.gateway.codec import pack_ids, pack_logprobs
from inharness.gateway.settings import GatewaySettings
from inharness.gateway.store import CallRecord, Conflict, SchemaTooNew, Store
from inharness.gateway.store.migrations import LATEST, MIGRATIONS
from inharness.gateway.store.store import store_url
from inharness.gateway.store.tables import attempts, calls, metadata, rollouts, schema_version


@pytest.fixture(params=["sqlite", "postgresql"], name="url")
def url_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new store's URL on each backend: a file, or a database of its own on the session's server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gw.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def store(url: str) -> AsyncIterator[Store]:
    s = await Store.open(url)
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


async def test_a_claim_repeated_with_its_key_gets_its_attempts_again_rekeyed_and_claims_nothing_new(
    store: Store,
) -> None:
    """What a claimer whose answer was lost (the gateway killed between commit and reply) relies on."""
    ids = await store.create_rollouts(schema.CreateRollouts(tasks=["a", "b", "c"]), default_max_attempts=1)
    lost = await store.claim_many("default", 1, 2, claim_key="key-of-the-first-claim")
    again = await store.claim_many("default", 60, 2, claim_key="key-of-the-first-claim")
    assert [a.id for a in again] == [a.id for a in lost] and [a.rollout_id for a in again] == ids[:2]
    assert [(a.seq, a.task) for a in again] == [(a.seq, a.task) for a in lost]
    assert all(a.lease_expires_at > time.time() + 30 for a in again)  # the repeat's lease, renewed
    assert await store.attempt_by_token(lost[0].token) is None  # only the answer received holds a key
    assert (await store.attempt_by_token(again[0].token)).id == lost[0].id
    other = await store.claim("default", 60, claim_key="key-of-another-claim")
    assert other.rollout_id == ids[2]
    await store.complete(other.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    assert await store.claim("default", 60, claim_key="key-of-another-claim") is None  # it ended: not new
    assert [r.status for r in await store.get_rollouts(ids)] == ["running", "running", "succeeded"]


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


async def test_a_call_committed_after_its_attempt_ended_is_refused_and_its_batch_mates_land(
    store: Store,
) -> None:
    """The liveness check is in the commit's transaction: a completion or a passed lease between a
    call's start and its record leaves the call out; calls of live attempts in the same group commit
    are recorded all the same."""
    await store.create_rollouts(schema.CreateRollouts(tasks=["a", "b", "c"]), default_max_attempts=1)
    done, live, lapsed = [await store.claim("default", 60) for _ in range(3)]
    assert done and live and lapsed
    await store.complete(done.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    await store.heartbeat(lapsed.id, 0.001)
    await asyncio.sleep(0.01)  # past that lease: the store compares it with the clock
    results = await asyncio.gather(
        *(store.record_calls([_record(a, 0)]) for a in (done, live, lapsed)), return_exceptions=True
    )
    assert [type(r).__name__ for r in results] == ["AttemptEnded", "NoneType", "AttemptEnded"]
    assert [len(await store.list_calls(a.id)) for a in (done, live, lapsed)] == [0, 1, 0]


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


# --- continuations: stored as their new prompt ids ------------------------------------------------------


def _turn(
    attempt: schema.ClaimedAttempt,
    n: int,
    prompt: list[int],
    parent: CallRecord | None,
    *,
    reused: bool = True,
) -> CallRecord:
    """Call `n` of a conversation: `prompt` (whole), a 20-id response of its own, extending `parent`."""
    rec = _record(attempt, n)
    rec.prompt_ids, rec.response_ids = prompt, [n * 1000 + i for i in range(20)]
    rec.response_logprobs = [-0.1] * 20
    rec.parent_call_id = None if parent is None else parent.id
    rec.prefix_reused = parent is not None and reused
    return rec


async def _stored(url: str) -> dict[int, tuple[int, int | None]]:
    """Per call id: (bytes of its stored prompt ids, its prompt_prefix), as the database holds them."""
    engine = create_async_engine(store_url(url))
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, length(prompt_ids), prompt_prefix FROM calls"))
            return {r[0]: (r[1], r[2]) for r in rows}
    finally:
        await engine.dispose()


async def test_a_continuation_stores_only_its_new_prompt_ids_and_every_read_gives_the_whole_prompt(
    store: Store, url: str
) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    attempt = await store.claim("default", 60)
    chain: list[CallRecord] = []
    prompt = list(range(5000, 6000))  # a long first context
    for n in range(6):
        rec = _turn(attempt, n, prompt, chain[-1] if chain else None)
        await store.record_calls([rec])
        chain.append(rec)
        prompt = rec.prompt_ids + rec.response_ids + [n] * 30  # the next turn adds 30 ids
    # Two choices of one request extend the same parent; a prompt claimed reused that is not (its
    # ids do not continue the parent's) is kept whole.
    fan = [_turn(attempt, 10 + i, prompt, chain[-1]) for i in range(2)]
    odd = _turn(attempt, 20, [7] * 50 + prompt, chain[-1])
    redo = _turn(attempt, 21, prompt, chain[-1], reused=False)
    await store.record_calls([*fan, odd, redo])
    records = [*chain, *fan, odd, redo]

    stored = await _stored(url)
    assert stored[chain[0].id] == (4 * 1000, None)
    for parent, child in itertools.pairwise(chain):
        assert stored[child.id] == (4 * 30, len(parent.prompt_ids) + 20)
    assert [stored[r.id] for r in fan] == [(4 * 30, len(chain[-1].prompt_ids) + 20)] * 2
    assert stored[odd.id] == (4 * len(odd.prompt_ids), None) and stored[redo.id] == (4 * len(prompt), None)

    listed = await store.list_calls(attempt.id, bodies=False)
    assert [c.prompt_ids for c in listed] == [r.prompt_ids for r in records]
    parent, digest = await store.find_call_by_reply(attempt.id, ["nothing", chain[3].reply_digest])
    assert (parent.id, parent.prompt_ids, parent.response_ids, digest) == (
        chain[3].id,
        chain[3].prompt_ids,
        chain[3].response_ids,
        chain[3].reply_digest,
    )
    assert await store.find_call_by_request(attempt.id, fan[1].request_digest) == prompt
    await store.complete(attempt.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    (exported,) = await store.export(after=0, limit=1, bodies=False)
    assert [c.prompt_ids for c in exported.calls] == [r.prompt_ids for r in records]


# --- request bodies: a continuation's stored as the items its conversation list adds ----------------------

# A first turn of each protocol the store sees, and what the next turn appends to its list. Key order
# differs from sorted (`model` after `messages`), and values a Python comparison would take as equal
# to others (1 and true, 1.0) are in them, to show that the round trip is exact.
_FIRST_BODIES: dict[str, tuple[dict[str, Any], str]] = {
    "openai.chat": (
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
            "model": "m",
            "temperature": 1.0,
            "n": 1,
        },
        "messages",
    ),
    "anthropic.messages": (
        {
            "model": "m",
            "system": "be brief",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "2+3?"}]}],
        },
        "messages",
    ),
    "openai.responses": (
        {
            "model": "m",
            "instructions": "be brief",
            "messages": "not a list",
            "input": [{"type": "message", "role": "user", "content": "2+3?"}],
            "store": True,
        },
        "input",
    ),
}


def _next_items(turn: int) -> list[Any]:
    """What a turn appends: the previous reply and a tool result (values 1, true, 1.0 on purpose)."""
    reply = {"role": "assistant", "content": f"call {turn}", "tool_calls": [{"id": f"c{turn}", "index": 1}]}
    return [reply, {"role": "tool", "tool_call_id": f"c{turn}", "content": "5", "ok": True, "score": 1.0}]


async def _stored_bodies(url: str) -> dict[int, tuple[int | None, str]]:
    """Per call id: (body_prefix, its request_body as the database holds it, text)."""
    engine = create_async_engine(store_url(url))
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT id, body_prefix, CAST(request_body AS TEXT) FROM calls"))
            return {r[0]: (r[1], r[2]) for r in rows}
    finally:
        await engine.dispose()


@pytest.mark.parametrize("protocol", sorted(_FIRST_BODIES))
async def test_a_continuation_stores_only_the_body_items_it_adds_and_every_reader_gives_the_exact_body(
    store: Store, url: str, protocol: str
) -> None:
    await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    attempt = await store.claim("default", 60)
    first, key = _FIRST_BODIES[protocol]
    chain: list[CallRecord] = []
    body = first
    for n in range(5):
        rec = _turn(attempt, n, [1, 2, 3], chain[-1] if chain else None)
        rec.protocol, rec.request_body = protocol, body
        rec.response_body = {"id": f"r{n}", "object": "response", "n": n}
        await store.record_calls([rec])
        chain.append(rec)
        body = {**body, key: body[key] + _next_items(n)}
    # Children of the last turn: an edited history (its first item changed), the same items with keys
    # reordered, with `true` where the parent has 1, and one that appends nothing, alongside one that
    # extends it. Only the ones whose list starts with the parent's, byte for byte, are kept short.
    parent, items = chain[-1], chain[-1].request_body[key]
    edited = [{**items[0], "content": "changed"}, *items[1:], *_next_items(9)]
    reordered = [dict(reversed(items[-1].items())), *_next_items(9)]
    reordered = [*items[:-1], *reordered]
    retyped = [*items[:-2], {**items[-2], "tool_calls": [{"id": "c3", "index": True}]}, items[-1]]
    variants = {
        "edited": edited,
        "reordered": reordered,
        "retyped": retyped,
        "same": items,
        "extends": [*items, *_next_items(9)],
    }
    children = []
    for n, name in enumerate(variants):
        child = _turn(attempt, 10 + n, [1, 2, 3], parent, reused=False)
        child.protocol, child.request_body = protocol, {**parent.request_body, key: variants[name]}
        children.append(child)
    await store.record_calls(children)
    records = [*chain, *children]

    stored = await _stored_bodies(url)
    assert stored[chain[0].id][0] is None
    for before, rec in itertools.pairwise(chain):
        assert stored[rec.id][0] == len(before.request_body[key])
        assert len(stored[rec.id][1]) < 400  # the two new items and the other keys, not the history
    by_name = {name: stored[c.id][0] for name, c in zip(variants, children, strict=True)}
    assert by_name == {
        "edited": None,
        "reordered": None,
        "retyped": None,
        "same": len(items),
        "extends": len(items),
    }

    def exact(body: Any) -> str:
        return json.dumps(body)  # key order and 1 / 1.0 / true all show in the text

    listed = await store.list_calls(attempt.id)
    assert [exact(c.request) for c in listed] == [exact(r.request_body) for r in records]
    assert [c.response for c in listed] == [r.response_body for r in records]
    for rec in records:
        request, response = await store.call_bodies(attempt.id, rec.request_id)
        assert (exact(request), response) == (exact(rec.request_body), rec.response_body)
    await store.complete(attempt.id, schema.CompleteRequest(status="succeeded", reward=1.0))
    (exported,) = await store.export(after=0, limit=1, bodies=True)
    assert [exact(c.request) for c in exported.calls] == [exact(r.request_body) for r in records]
    (bare,) = await store.export(after=0, limit=1, bodies=False)
    assert {(c.request, c.response) for c in bare.calls} == {(None, None)}


async def test_with_bodies_none_calls_keep_their_ids_and_logprobs_and_no_body(url: str) -> None:
    store = await Store.open(url, bodies="none")
    try:
        await store.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
        attempt = await store.claim("default", 60)
        first = _turn(attempt, 0, [1, 2, 3], None)
        first.request_body = _FIRST_BODIES["openai.chat"][0]
        await store.record_calls([first])
        second = _turn(attempt, 1, [*first.prompt_ids, *first.response_ids, 4], first)
        second.request_body = {**first.request_body, "messages": first.request_body["messages"] + [{}]}
        await store.record_calls([second])
        listed = await store.list_calls(attempt.id)
        assert [(c.request, c.response) for c in listed] == [(None, None)] * 2
        assert [(c.prompt_ids, c.response_ids) for c in listed] == [
            (r.prompt_ids, r.response_ids) for r in (first, second)
        ]
        assert listed[1].response_logprobs == pytest.approx(second.response_logprobs)
        assert await store.call_bodies(attempt.id, second.request_id) == (None, None)
        assert await store.call_bodies(attempt.id, "no such call") is None
        assert (await _stored(url))[second.id] == (4, len(first.prompt_ids) + 20)  # ids still continue
        assert {text for _, text in (await _stored_bodies(url)).values()} == {"null"}
    finally:
        await store.close()


# --- migrations ------------------------------------------------------------------------------------------


async def _schema(url: str) -> dict[str, Any]:
    """Tables, columns (type, nullable), keys and indexes of the store at `url`, as reflected."""

    def reflect(conn: Connection) -> dict[str, Any]:
        insp = inspect(conn)
        return {
            t: {
                "columns": {c["name"]: (str(c["type"]), c["nullable"]) for c in insp.get_columns(t)},
                "pk": insp.get_pk_constraint(t)["constrained_columns"],
                "unique": sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(t)),
                "fks": sorted(
                    (tuple(f["constrained_columns"]), f["referred_table"]) for f in insp.get_foreign_keys(t)
                ),
                "indexes": sorted(
                    (i["name"], tuple(i["column_names"]), i["unique"]) for i in insp.get_indexes(t)
                ),
            }
            for t in insp.get_table_names()
        }

    engine = create_async_engine(store_url(url))
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(reflect)
    finally:
        await engine.dispose()


async def _tables_py_schema(url: str) -> dict[str, Any]:
    """The schema `tables.py` describes, made with create_all in the empty database at `url`."""
    engine = create_async_engine(store_url(url))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
    finally:
        await engine.dispose()
    return await _schema(url)


async def _versions(url: str) -> list[int]:
    engine = create_async_engine(store_url(url))
    try:
        async with engine.connect() as conn:
            return list(
                (await conn.execute(text("SELECT version FROM schema_version ORDER BY version"))).scalars()
            )
    finally:
        await engine.dispose()


async def _second_url(url: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Another empty store on the same backend as `url`."""
    if url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'reference.db'}"
    return request.getfixturevalue("postgres").create_database()


async def test_a_new_store_migrates_to_exactly_the_tables_of_tables_py(
    store: Store, url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    reference = await _tables_py_schema(await _second_url(url, tmp_path, request))
    assert await _schema(url) == reference
    assert await _versions(url) == [m.version for m in MIGRATIONS] == list(range(1, LATEST + 1))


@pytest.mark.parametrize("url", ["mysql://u:secret@db/x", "postgres://u:secret@db/x", "not a url"])
def test_a_store_url_the_store_cannot_open_is_refused_at_start_without_repeating_it(url: str) -> None:
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(model="m", admin_token="t" * 16, store=url)
    (error,) = refused.value.errors()
    assert error["loc"] == ("store",) and "sqlite:///PATH or postgresql://" in error["msg"]
    assert "secret" not in error["msg"]


async def test_reopening_a_store_applies_nothing_and_a_newer_store_is_refused(url: str) -> None:
    first = await Store.open(url)
    await first.create_rollouts(schema.CreateRollouts(tasks=["t"]), default_max_attempts=1)
    await first.close()
    again = await Store.open(url)
    try:
        assert await again.count_rollouts("queued") == 1
    finally:
        await again.close()
    assert await _versions(url) == list(range(1, LATEST + 1))

    engine = create_async_engine(store_url(url))
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO schema_version (version, name, applied_at) VALUES (:v, 'from the future', 0)"),
            {"v": LATEST + 1},
        )
    await engine.dispose()
    with pytest.raises(SchemaTooNew, match=f"schema version {LATEST + 1}, newer than this gateway knows"):
        await Store.open(url)


async def _store_at_version_7(url: str) -> tuple[str, list[dict[str, Any]]]:
    """A store at schema version 7 holding a running attempt with two calls, the second continuing the
    first with its request body stored whole (as every body was before migration 8): (attempt id, the
    calls' request bodies)."""
    bodies = [dict(_FIRST_BODIES["openai.chat"][0])]
    bodies.append({**bodies[0], "messages": bodies[0]["messages"] + _next_items(0)})
    now = time.time()
    engine = create_async_engine(store_url(url))

    def build(conn: Connection) -> None:
        schema_version.create(conn)
        for migration in MIGRATIONS[:7]:
            migration.apply(conn)
            conn.execute(
                insert(schema_version).values(version=migration.version, name=migration.name, applied_at=now)
            )
        conn.execute(
            insert(rollouts).values(
                id="ro-1",
                group_id="grp-1",
                pool="default",
                task="t",
                labels={},
                status="running",
                max_attempts=1,
                attempts_started=1,
                created_seq=1,
                created_at=now,
            )
        )
        conn.execute(
            insert(attempts).values(
                id="at-1",
                rollout_id="ro-1",
                seq=1,
                pool="default",
                token_hash="hash",
                status="running",
                lease_seconds=600,
                claimed_at=now,
                lease_expires_at=now + 600,
                info={},
            )
        )
        parent = None
        for n, body in enumerate(bodies, start=1):
            parent = conn.scalar(
                insert(calls)
                .values(
                    attempt_id="at-1",
                    rollout_id="ro-1",
                    request_id=f"r{n}",
                    choice_index=0,
                    protocol="openai.chat",
                    requested_model="m",
                    model_version=0,
                    engine="e",
                    prompt_ids=pack_ids([1, 2, n]),
                    response_ids=pack_ids([7, n]),
                    response_logprobs=pack_logprobs([-0.5, -1.0]),
                    finish_reason="stop",
                    parent_call_id=parent,
                    prefix_reused=False,
                    request_digest=f"q{n}",
                    reply_digest=f"a{n}",
                    started_at=now,
                    finished_at=now,
                    request_body=body,
                    response_body={"n": n},
                )
                .returning(calls.c.id)
            )

    try:
        async with engine.begin() as conn:
            await conn.run_sync(build)
    finally:
        await engine.dispose()
    return "at-1", bodies


async def test_a_store_at_version_7_keeps_its_bodies_and_its_new_continuations_are_stored_short(
    url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    attempt_id, old_bodies = await _store_at_version_7(url)
    assert await _versions(url) == list(range(1, 8))
    store = await Store.open(url)
    try:
        assert [c.request for c in await store.list_calls(attempt_id)] == old_bodies
        # The old call has no digest to check against: its child is stored whole, the grandchild short.
        attempt = schema.ClaimedAttempt(
            id=attempt_id, rollout_id="ro-1", group_id="grp-1", seq=1, task="t", token="k", lease_expires_at=0
        )
        third, fourth = _turn(attempt, 3, [1, 2, 3], None), _turn(attempt, 4, [1, 2, 3], None)
        third.parent_call_id = (await store.list_calls(attempt_id))[1].id
        third.request_body = {**old_bodies[1], "messages": old_bodies[1]["messages"] + _next_items(1)}
        await store.record_calls([third])
        fourth.parent_call_id = third.id
        fourth.request_body = {
            **third.request_body,
            "messages": third.request_body["messages"] + _next_items(2),
        }
        await store.record_calls([fourth])
        stored = await _stored_bodies(url)
        assert [stored[i][0] for i in sorted(stored)] == [None, None, None, 6]
        bodies = [*old_bodies, third.request_body, fourth.request_body]
        assert [c.request for c in await store.list_calls(attempt_id)] == bodies
        assert (await store.call_bodies(attempt_id, fourth.request_id)) == (fourth.request_body, {})
    finally:
        await store.close()
    assert await _versions(url) == list(range(1, LATEST + 1))
    assert await _schema(url) == await _tables_py_schema(await _second_url(url, tmp_path, request))


# The tables exactly as the gateway made them before the migration list (commit 98c637c, through
# `create_all`), as SQLite holds them; the oldest stores lack `notes`, `turns_digest` and `posted_rewards`.
_STORE_BEFORE_MIGRATIONS = """
CREATE TABLE rollouts (
    id VARCHAR(40) NOT NULL, group_id VARCHAR(40) NOT NULL, pool VARCHAR(253) NOT NULL, task JSON NOT NULL,
    labels JSON NOT NULL, status VARCHAR(16) NOT NULL, reward FLOAT, max_attempts INTEGER NOT NULL,
    attempts_started INTEGER NOT NULL, created_seq INTEGER NOT NULL, created_at FLOAT NOT NULL,
    finished_at FLOAT, finish_seq INTEGER, PRIMARY KEY (id), UNIQUE (finish_seq)
);
CREATE INDEX ix_rollouts_claim ON rollouts (pool, status, created_seq);
CREATE INDEX ix_rollouts_group_id ON rollouts (group_id);
CREATE TABLE model_versions (
    version INTEGER NOT NULL, engines JSON NOT NULL, active BOOLEAN NOT NULL, created_at FLOAT NOT NULL,
    PRIMARY KEY (version)
);
CREATE TABLE attempts (
    id VARCHAR(40) NOT NULL, rollout_id VARCHAR(40) NOT NULL, seq INTEGER NOT NULL,
    pool VARCHAR(253) NOT NULL, token_hash VARCHAR(64) NOT NULL, status VARCHAR(16) NOT NULL,
    lease_seconds FLOAT NOT NULL, claimed_at FLOAT NOT NULL, lease_expires_at FLOAT NOT NULL,
    finished_at FLOAT, reward FLOAT, failure_reason TEXT, info JSON NOT NULL, PRIMARY KEY (id),
    FOREIGN KEY(rollout_id) REFERENCES rollouts (id), UNIQUE (token_hash)
);
CREATE INDEX ix_attempts_rollout_id ON attempts (rollout_id);
CREATE INDEX ix_attempts_lease ON attempts (status, lease_expires_at);
CREATE TABLE posted_rewards (
    attempt_id VARCHAR(40) NOT NULL, reward FLOAT NOT NULL, info JSON NOT NULL, posted_at FLOAT NOT NULL,
    posts INTEGER NOT NULL, PRIMARY KEY (attempt_id), FOREIGN KEY(attempt_id) REFERENCES attempts (id)
);
CREATE TABLE calls (
    id INTEGER NOT NULL, attempt_id VARCHAR(40) NOT NULL, rollout_id VARCHAR(40) NOT NULL,
    request_id VARCHAR(64) NOT NULL, choice_index INTEGER NOT NULL, protocol VARCHAR(32) NOT NULL,
    requested_model TEXT NOT NULL, model_version INTEGER NOT NULL, engine TEXT NOT NULL,
    prompt_ids BLOB NOT NULL, response_ids BLOB NOT NULL, response_logprobs BLOB NOT NULL,
    finish_reason VARCHAR(16) NOT NULL, parent_call_id INTEGER, prefix_reused BOOLEAN NOT NULL,
    prefix_mismatch VARCHAR(64), request_digest VARCHAR(32) NOT NULL, reply_digest VARCHAR(32) NOT NULL,
    started_at FLOAT NOT NULL, first_token_at FLOAT, finished_at FLOAT NOT NULL, request_body JSON NOT NULL,
    response_body JSON NOT NULL, notes JSON, turns_digest VARCHAR(32), PRIMARY KEY (id),
    FOREIGN KEY(attempt_id) REFERENCES attempts (id)
);
CREATE INDEX ix_calls_attempt ON calls (attempt_id, id);
CREATE INDEX ix_calls_reply ON calls (attempt_id, reply_digest);
CREATE INDEX ix_calls_request ON calls (attempt_id, request_digest);
"""


def _store_before_migrations(db: Path, *, oldest: bool) -> None:
    """A store file as the gateway left it before the migration list, holding one finished rollout
    (two calls, a posted reward unless `oldest`), one queued rollout and model version 0."""
    with sqlite3.connect(db) as conn:
        conn.executescript(_STORE_BEFORE_MIGRATIONS)
        if oldest:
            conn.executescript(
                "DROP TABLE posted_rewards; ALTER TABLE calls DROP COLUMN notes;"
                "ALTER TABLE calls DROP COLUMN turns_digest;"
            )
        rollout = "INSERT INTO rollouts VALUES (?, 'grp-1', 'default', ?, '{}', ?, ?, 1, ?, ?, 100.0, ?, ?)"
        conn.execute(rollout, ("ro-done", '"old task"', "succeeded", 0.5, 1, 1, 101.0, 1))
        conn.execute(rollout, ("ro-queued", '"waiting"', "queued", None, 0, 2, None, None))
        conn.execute(
            "INSERT INTO attempts VALUES ('at-done', 'ro-done', 1, 'default', 'hash', 'succeeded', 60, 100.0,"
            " 160.0, 101.0, 0.5, NULL, '{}')"
        )
        if not oldest:
            conn.execute("INSERT INTO posted_rewards VALUES ('at-done', 0.5, '{}', 100.5, 1)")
        for n, parent in ((1, None), (2, 1)):
            conn.execute(
                "INSERT INTO calls (id, attempt_id, rollout_id, request_id, choice_index, protocol,"
                " requested_model, model_version, engine, prompt_ids, response_ids, response_logprobs,"
                " finish_reason, parent_call_id, prefix_reused, request_digest, reply_digest, started_at,"
                " finished_at, request_body, response_body)"
                " VALUES (?, 'at-done', 'ro-done', ?, 0, 'openai.chat', 'm', 0, 'e', ?, ?, ?, 'stop', ?, ?,"
                " ?, ?, 100.0, 100.5, ?, '{}')",
                (
                    n,
                    f"r{n}",
                    pack_ids([1, 2, n]),
                    pack_ids([7, n]),
                    pack_logprobs([-0.5, -1.0]),
                    parent,
                    parent is not None,
                    f"q{n}",
                    f"a{n}",
                    f'{{"n": {n}}}',
                ),
            )
        conn.execute("INSERT INTO model_versions VALUES (0, '[\"http://engine\"]', 1, 99.0)")


@pytest.mark.parametrize("oldest", [False, True], ids=["last-store-before-migrations", "first-stores"])
async def test_a_store_made_before_migrations_keeps_its_data_and_continues_its_sequences(
    tmp_path: Path, oldest: bool
) -> None:
    db = tmp_path / "old.db"
    _store_before_migrations(db, oldest=oldest)
    url = f"sqlite:///{db}"
    store = await Store.open(url)
    try:
        (old,) = await store.export(after=0, limit=10, bodies=True)
        assert (old.cursor, old.rollout.id, old.rollout.task, old.rollout.reward) == (
            1,
            "ro-done",
            "old task",
            0.5,
        )
        assert [(c.prompt_ids, c.response_logprobs, c.parent_call_id, c.notes) for c in old.calls] == [
            ([1, 2, 1], [-0.5, -1.0], None, []),
            ([1, 2, 2], [-0.5, -1.0], 1, []),
        ]
        posted = await store.posted_reward("at-done")
        assert (posted is None) == oldest
        assert [(v.version, v.engines, v.active) for v in await store.list_versions()] == [
            (0, ["http://engine"], True)
        ]

        (new_id,) = await store.create_rollouts(schema.CreateRollouts(tasks=["new"]), default_max_attempts=1)
        first, second = await store.claim("default", 60), await store.claim("default", 60)
        assert (first.rollout_id, second.rollout_id) == ("ro-queued", new_id)  # created_seq continues
        noted = _record(first, 3)
        noted.notes, noted.turns_digest = ["tools[1] is left out"], "t3"
        await store.record_calls([noted])
        assert noted.id == 3 and (await store.list_calls(first.id))[0].notes == ["tools[1] is left out"]
        assert (await store.call_digests(first.id))[2] == {"t3"}
        await store.post_reward(first.id, 1.0, {})
        await store.complete(first.id, schema.CompleteRequest(status="succeeded", reward=1.0))
        assert [e.cursor for e in await store.export(after=1, limit=10, bodies=False)] == [2]  # finish_seq
    finally:
        await store.close()
    assert await _versions(url) == list(range(1, LATEST + 1))
    assert await _schema(url) == await _tables_py_schema(f"sqlite:///{tmp_path / 'reference.db'}")
