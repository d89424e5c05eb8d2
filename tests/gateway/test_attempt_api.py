"""The gateway's attempt API beyond model calls, as a real server on 127.0.0.1 (no engine: none of
this needs one): a harness posting its own reward with its attempt's key, what the control API
tells about it, and batch claims."""

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ADMIN
from testsupport import Server, eventually, gateway_server

from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.schema import ClaimedAttempt


@pytest.fixture(scope="module")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("attempt-api") / "gateway.db"
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


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
