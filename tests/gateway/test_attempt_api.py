"""The gateway's attempt API beyond model calls, as a real server on 127.0.0.1 (no engine, except
where a completion counts calls made through the harness API): a harness posting its own reward with
its attempt's key, what the control API tells about it, batch claims, released attempts and held
rollouts."""

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ADMIN
from gwhelpers import serve
from testsupport import Server, eventually, gateway_server

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("attempt-api") / "gateway.db"
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    """A gateway in front of a real engine, for the tests that make model calls."""
    yield from serve(engine, tool_model, tmp_path_factory, log_dir)


async def claimed(gw: GatewayClient, pool: str, lease_seconds: float = 600) -> ClaimedAttempt:
    await gw.create_rollouts([{"q": 1}], pool=pool)
    attempt = await gw.claim(pool, lease_seconds)
    assert attempt is not None
    return attempt


async def post(gw: Server, token: str | None, body: Any, *, in_path: bool = False) -> httpx.Response:
    url = f"{gw.url}/t/{token}/v1/inharness/reward" if in_path else f"{gw.url}/v1/inharness/reward"
    headers = {"Authorization": f"Bearer {token}"} if token is not None and not in_path else {}
    async with httpx.AsyncClient(timeout=30) as h:
        if isinstance(body, bytes):
            return await h.post(url, content=body, headers={**headers, "content-type": "application/json"})
        return await h.post(url, json=body, headers=headers)


# --- posted rewards -------------------------------------------------------------------------------------


async def test_a_harness_posts_its_reward_by_header_or_path_key_and_the_latest_post_is_kept(
    gateway: Server,
) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        attempt = await claimed(gw, "post-ok")
        assert await gw.posted_reward(attempt.id) is None  # nothing posted yet

        r = await post(gateway, attempt.token, {"reward": 0.25, "steps": 3})
        assert r.status_code == 200, r.text
        assert r.json()["attempt_id"] == attempt.id and r.json()["reward"] == 0.25
        first = await gw.posted_reward(attempt.id)
        assert first is not None and (first.reward, first.info, first.posts) == (0.25, {"steps": 3}, 1)

        r = await post(gateway, attempt.token, {"reward": 1}, in_path=True)  # an int is a number too
        assert r.status_code == 200, r.text
        latest = await gw.posted_reward(attempt.id)
        assert latest is not None and (latest.reward, latest.info, latest.posts) == (1.0, {}, 2)
        # Posting changes nothing else: the attempt still runs until the controller completes it.
        assert (await gw.get_rollout(attempt.rollout_id)).attempts[0].status == "running"


async def test_a_posted_reward_needs_the_live_key_of_a_running_attempt(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        r = await post(gateway, None, {"reward": 1.0})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await post(gateway, "ih-not-a-key", {"reward": 1.0})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await post(gateway, ADMIN, {"reward": 1.0})  # the admin token is no attempt's key
        assert r.status_code == 401

        done = await claimed(gw, "post-auth")
        await gw.complete(done.id, "succeeded", 0.5)
        r = await post(gateway, done.token, {"reward": 1.0})
        assert r.status_code == 403 and r.json()["error"]["code"] == "attempt_finished"
        assert await gw.posted_reward(done.id) is None

        expiring = await claimed(gw, "post-auth", lease_seconds=0.5)

        async def refused() -> bool:
            return (await post(gateway, expiring.token, {"reward": 1.0})).status_code == 403

        # Until its lease passes a post is kept; after that every post is refused.
        await eventually(refused, "a post after the lease passed is refused", within=10)
        with pytest.raises(GatewayError) as err:
            await gw.posted_reward("at-unknown")
        assert err.value.status == 404


BAD_REWARDS: list[tuple[str, Any, int]] = [
    ("no reward", {"score": 1.0}, 400),
    ("a bool", {"reward": True}, 400),
    ("a string", {"reward": "1.0"}, 400),
    ("not finite", b'{"reward": 1e999}', 400),  # valid JSON, parsed as infinity
    ("not an object", [1.0], 400),
    ("too much info", {"reward": 1.0, "log": "x" * 70_000}, 413),
]


@pytest.mark.parametrize(("case", "body", "status"), BAD_REWARDS, ids=[c for c, _, _ in BAD_REWARDS])
async def test_a_posted_reward_must_be_one_finite_number_and_a_refused_post_keeps_nothing(
    gateway: Server, case: str, body: Any, status: int
) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        attempt = await claimed(gw, f"post-bad-{case.replace(' ', '-')}")
        r = await post(gateway, attempt.token, body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert await gw.posted_reward(attempt.id) is None


# --- a claim whose answer was lost ---------------------------------------------------------------------


@asynccontextmanager
async def losing_first_answer(upstream: str, path: str) -> AsyncIterator[str]:
    """A relay on 127.0.0.1 in front of the gateway: each request goes through whole, one per connection;
    the first answer to `path` is read from the gateway and thrown away, the connection closed, as
    when a gateway is killed between the commit and the reply. Yields the relay's URL."""
    host, port = upstream.removeprefix("http://").split(":")
    lost: list[bool] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length:")), 0)
        body = await reader.readexactly(length)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        up_writer.write(head.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1) + body)
        answer = await up_reader.read()  # the gateway closes after the answer
        up_writer.close()
        if lines[0].split()[1] == path and not lost:
            lost.append(True)
        else:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("batch", [False, True], ids=["claim", "claim-batch"])
async def test_a_claim_whose_answer_was_lost_is_answered_by_its_repeat_not_left_to_its_lease(
    gateway: Server, batch: bool
) -> None:
    pool, route = (
        f"lost-answer-{batch}",
        "/api/v1/attempts/claim-batch" if batch else "/api/v1/attempts/claim",
    )
    async with (
        GatewayClient(gateway.url, ADMIN) as gw,
        losing_first_answer(gateway.url, route) as relay_url,
        GatewayClient(relay_url, ADMIN, connect_retry_seconds=10) as through,
    ):
        made = await gw.create_rollouts([{"q": 1}, {"q": 2}], pool=pool)
        if batch:
            got = await through.claim_batch(pool, 600, limit=1, claim_key="a-key-for-one-claim")
        else:
            got = [await through.claim(pool, 600, claim_key="a-key-for-one-claim")]
        (attempt,) = got
        assert attempt is not None and attempt.rollout_id == made[0].id
        ro = await gw.get_rollout(made[0].id)
        assert [a.id for a in ro.attempts] == [attempt.id]  # the first claim's attempt, not a second one
        assert (await gw.get_rollout(made[1].id)).status == "queued"
        r = await post(gateway, attempt.token, {"reward": 0.5})  # the key handed out works
        assert r.status_code == 200, r.text


# --- batch claims ---------------------------------------------------------------------------------------


async def test_a_batch_claim_takes_up_to_limit_of_the_oldest_queued_each_with_its_own_live_key(
    gateway: Server,
) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        made = await gw.create_rollouts([{"i": i} for i in range(5)], pool="batch-claim")
        first = await gw.claim_batch("batch-claim", 60, limit=3)
        rest = await gw.claim_batch("batch-claim", 60, limit=10)
        assert await gw.claim_batch("batch-claim", 60, limit=10) == []  # none queued: empty, not an error
        claimed = first + rest
        assert [a.rollout_id for a in claimed] == [r.id for r in made]  # oldest first, each once
        assert [a.task for a in claimed] == [{"i": i} for i in range(5)]
        assert len({a.id for a in claimed}) == len({a.token for a in claimed}) == 5
        assert {a.seq for a in claimed} == {1}
        for a in claimed:
            r = await gw.get_rollout(a.rollout_id)
            assert r.status == "running" and [x.id for x in r.attempts] == [a.id]
            assert (await post(gateway, a.token, {"reward": 0.5})).status_code == 200  # the key works


async def test_concurrent_batch_claims_never_hand_out_a_rollout_twice(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        made = await gw.create_rollouts([{"i": i} for i in range(50)], pool="batch-race")
        waves = await asyncio.gather(*(gw.claim_batch("batch-race", 60, limit=20) for _ in range(5)))
    rollouts = [a.rollout_id for wave in waves for a in wave]
    assert sorted(rollouts) == sorted(r.id for r in made)


async def test_a_batch_claim_gives_a_requeued_rollout_its_next_attempt(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        (made,) = await gw.create_rollouts([{"q": 1}], pool="batch-requeue", max_attempts=2)
        (first,) = await gw.claim_batch("batch-requeue", 0.5, limit=5)

        async def requeued() -> list[ClaimedAttempt]:
            return await gw.claim_batch("batch-requeue", 60, limit=5)  # expires passed leases first

        (second,) = await eventually(requeued, "the expired attempt's rollout claimed again", within=10)
    assert (second.rollout_id, second.seq) == (made.id, 2) and second.id != first.id


@pytest.mark.parametrize("limit", [0, 1001])
async def test_a_batch_claim_limit_outside_1_to_1000_is_refused(gateway: Server, limit: int) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}) as h:
        r = await h.post("/api/v1/attempts/claim-batch", json={"pool": "batch-limit", "limit": limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


# --- released attempts ----------------------------------------------------------------------------------


async def test_a_released_attempt_requeues_its_rollout_at_once_without_using_up_an_attempt(
    gateway: Server,
) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        (made,) = await gw.create_rollouts([{"q": 1}], pool="release-one", max_attempts=1)
        first = await gw.claim("release-one", 600)
        assert first is not None
        out, dup = await gw.complete(first.id, "released", info={"reason": "runner stopped (Ctrl-C)"})
        assert not dup and (out.status, out.failure_reason, out.calls) == (
            "released",
            "runner stopped (Ctrl-C)",
            0,
        )
        again, dup = await gw.complete(first.id, "released", info={"reason": "runner stopped (Ctrl-C)"})
        assert dup and again.status == "released"
        r = await post(gateway, first.token, {"reward": 1.0})
        assert r.status_code == 403  # a released attempt's key serves nothing more

        second = await gw.claim("release-one", 600)  # no lease to wait out
        assert second is not None and (second.rollout_id, second.seq) == (made.id, 2)
        await gw.complete(second.id, "failed")
        ro = await gw.get_rollout(made.id)
    assert ro.status == "failed" and [a.status for a in ro.attempts] == ["released", "failed"]


async def test_release_running_requeues_that_pools_running_attempts_and_leaves_other_pools_alone(
    gateway: Server,
) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        await gw.create_rollouts([{"i": i} for i in range(3)], pool="resume-mine", max_attempts=1)
        mine = await gw.claim_batch("resume-mine", 600, limit=3)
        other = await claimed(gw, "resume-theirs")

        assert await gw.release_running("resume-mine", reason="previous run died") == 3
        assert await gw.release_running("resume-mine") == 0

        for a in mine:
            ro = await gw.get_rollout(a.rollout_id)
            assert ro.status == "queued"
            assert (ro.attempts[0].status, ro.attempts[0].failure_reason) == ("released", "previous run died")
            assert (await post(gateway, a.token, {"reward": 0.5})).status_code == 403
        assert (await gw.get_rollout(other.rollout_id)).status == "running"
        assert (await post(gateway, other.token, {"reward": 0.5})).status_code == 200
        again = await gw.claim_batch("resume-mine", 600, limit=10)
    assert sorted(a.rollout_id for a in again) == sorted(a.rollout_id for a in mine)
    assert {a.seq for a in again} == {2}


# --- held rollouts --------------------------------------------------------------------------------------


async def test_a_held_rollout_is_not_claimed_until_it_is_unheld(gateway: Server) -> None:
    async with GatewayClient(gateway.url, ADMIN) as gw:
        now, later = await gw.create_rollouts([{"v": 1}, {"v": 2}], pool="hold")
        assert await gw.hold([later.id]) == 1
        assert (await gw.get_rollout(later.id)).status == "held"
        assert [a.rollout_id for a in await gw.claim_batch("hold", 60, limit=10)] == [now.id]
        assert await gw.claim("hold", 60) is None
        assert await gw.hold([now.id, later.id]) == 0  # running and held ones are left as they are
        assert await gw.unhold([now.id, later.id]) == 1
        unheld = await gw.claim("hold", 60)
    assert unheld is not None and unheld.rollout_id == later.id


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/pools/default/release-running", {}),
        ("/api/v1/rollouts/hold", {"ids": []}),
        ("/api/v1/rollouts/unhold", {"ids": []}),
    ],
)
async def test_release_and_hold_need_the_admin_token(gateway: Server, path: str, body: Any) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as h:
        r = await h.post(path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        r = await h.post(path, json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json() in ({"released": 0}, {"changed": 0}), r.text


# --- completion answer: recorded calls ------------------------------------------------------------------


async def chat(gw: Server, token: str, *, stream: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as h:
        r = await h.post("/v1/chat/completions", json=body, headers=headers)  # reads a stream to its end
    text = r.text
    assert r.status_code == 200, text
    assert not stream or text.rstrip().endswith("data: [DONE]")


async def test_the_completion_answer_counts_the_calls_answered_through_the_harness_api(
    served: Server,
) -> None:
    async with GatewayClient(served.url, ADMIN) as gw:
        silent = await claimed(gw, "count-calls")
        out, _ = await gw.complete(silent.id, "failed", info={"reason": "harness crashed"})
        assert out.calls == 0  # failed before any model call was recorded

        busy = await claimed(gw, "count-calls")
        await chat(served, busy.token, stream=False)
        await chat(served, busy.token, stream=True)
        await asyncio.gather(*(chat(served, busy.token, stream=s) for s in (False, True, False)))
        out, dup = await gw.complete(busy.id, "succeeded", 1.0)
        assert not dup and out.calls == 5 == len(await gw.calls(busy.id))
        out, dup = await gw.complete(busy.id, "succeeded", 1.0)
        assert dup and out.calls == 5
        assert (await gw.heartbeat((await claimed(gw, "count-calls")).id)).calls is None
