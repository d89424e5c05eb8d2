"""The one retry policy of the rollout controllers (rollouts/base.py): tries doubling their wait,
transient errors retried, others and the last one raised; failing claims backed off with jitter,
said once and then summarised."""

import asyncio
import itertools
import time

import httpx
import pytest
from testsupport import eventually

from inharness.gateway.client import GatewayError
from inharness.gateway.schema import MAX_HEARTBEAT_BATCH, AttemptOut, ClaimedAttempt, LeaseRenewal
from inharness.operator.rollouts import Outcome
from inharness.operator.rollouts.base import Abort, ClaimingController, backoff, gateway_transient, retry


def test_backoff_doubles_from_its_first_wait_up_to_its_cap() -> None:
    assert [backoff(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert [backoff(n, 0.05, 0.5) for n in range(1, 6)] == [0.05, 0.1, 0.2, 0.4, 0.5]


def test_gateway_errors_are_transient_when_a_retry_may_pass() -> None:
    assert gateway_transient(GatewayError(503, "busy")) and gateway_transient(httpx.ConnectError("no"))
    assert not gateway_transient(GatewayError(409, "lease expired")) and not gateway_transient(ValueError())


async def test_retry_retries_transient_errors_and_raises_the_others_and_the_last_one() -> None:
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise GatewayError(500, "oops")
        return "done"

    assert await retry(flaky, tries=3, transient=gateway_transient, first=0.001) == "done"
    assert len(calls) == 3

    async def refused() -> str:
        calls.append(1)
        raise GatewayError(409, "no")

    calls.clear()
    with pytest.raises(GatewayError):
        await retry(refused, tries=3, transient=gateway_transient, first=0.001)
    assert len(calls) == 1  # not transient: no second try

    async def down() -> str:
        calls.append(1)
        raise httpx.ConnectError("down")

    calls.clear()
    with pytest.raises(httpx.ConnectError):
        await asyncio.wait_for(retry(down, tries=4, transient=gateway_transient, first=0.001), 5)
    assert len(calls) == 4


def test_backoff_with_jitter_waits_a_random_part_less_never_more() -> None:
    waits = [backoff(3, 0.5, 10.0, jitter=0.5) for _ in range(200)]
    assert all(1.0 <= w <= 2.0 for w in waits) and len(set(waits)) > 100


class _Gateway:
    """A gateway whose claims fail (no connection) until `up`, then find an empty queue."""

    def __init__(self) -> None:
        self.up = False
        self.claims: list[float] = []
        self.keys: list[str | None] = []

    async def claim(self, pool: str, lease_seconds: float, claim_key: str | None = None) -> None:
        self.claims.append(time.monotonic())
        self.keys.append(claim_key)
        if not self.up:
            raise httpx.ConnectError("All connection attempts failed")


class _Idle(ClaimingController):
    claim_retry_first = 0.1
    claim_retry_cap = 1.0
    claim_summary_seconds = 1.0

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        raise AssertionError("nothing is ever claimed")


async def test_failing_claims_back_off_are_said_once_then_summarised_and_recover() -> None:
    gateway = _Gateway()
    said: list[str] = []
    warned: list[str] = []
    controller = _Idle(
        gateway,  # type: ignore[arg-type]
        "calc-pool",
        parallelism=2,
        lease_seconds=60,
        heartbeat_seconds=10,
        log=said.append,
    )
    warned_at: list[float] = []

    def warn(message: str) -> None:
        warned.append(message)
        warned_at.append(time.monotonic())

    controller.warn = warn
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        # Bounded by events, not by a sleep: on a loaded machine the same things happen later.
        await eventually(lambda: len(warned) >= 3, "the first warning and two summaries", within=20)
        # 0.1, 0.2, 0.4, 0.8, 1, 1, ... s, each less up to half: retries back off, never hammer
        gaps = [b - a for a, b in itertools.pairwise(gateway.claims)]
        assert min(gaps) >= 0.05 and max(gaps) >= 0.5, gaps
        trouble = controller.claim_trouble
        assert trouble is not None and trouble.reason == "ConnectError: All connection attempts failed"
        assert warned[0] == f"pool calc-pool: cannot claim from the gateway, backing off: {trouble.reason}"
        summaries = warned[1:]
        assert all("claim still failing for" in w for w in summaries), warned
        # said at most once per claim_summary_seconds (1 s here), not once per failed try
        assert all(b - a >= 0.99 for a, b in itertools.pairwise(warned_at)), warned_at
        assert len(warned) < len(gateway.claims)
        assert said == []
        failed = len(gateway.keys)
        gateway.up = True
        await eventually(lambda: controller.claim_trouble is None, "claims pass again", within=5)
        assert said == [said[0]] and said[0].startswith("pool calc-pool: claiming again after")
        await eventually(lambda: len(gateway.keys) > failed + 1, "a claim after the answered one", within=5)
        # Every unanswered claim is repeated with its key (it may have been taken); an answered one's is
        # not used again.
        first, answered, after = gateway.keys[0], gateway.keys[failed], gateway.keys[failed + 1]
        assert first is not None and set(gateway.keys[: failed + 1]) == {first} == {answered}
        assert after is not None and after != answered
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


class _Leases:
    """A gateway that hands out `n` attempts, records every heartbeat batch, answers the ids in
    `finished` as ended elsewhere, and fails the batch requests while `down`. A heartbeat of one
    attempt is a test failure: leases are renewed in batches only."""

    def __init__(self, n: int) -> None:
        self.queue = [
            ClaimedAttempt(
                id=f"at-{i}",
                rollout_id=f"ro-{i}",
                group_id="g",
                seq=1,
                task={},
                token="t",
                lease_expires_at=0,
            )
            for i in range(n)
        ]
        self.batches: list[list[str]] = []
        self.finished: set[str] = set()
        self.down = False
        self.completed: dict[str, str] = {}

    async def claim(
        self, pool: str, lease_seconds: float, claim_key: str | None = None
    ) -> ClaimedAttempt | None:
        return self.queue.pop(0) if self.queue else None

    async def heartbeat(self, attempt_id: str, lease_seconds: float | None = None) -> None:
        raise AssertionError(f"a heartbeat request for attempt {attempt_id} alone")

    async def heartbeat_batch(
        self, attempt_ids: list[str], lease_seconds: float | None
    ) -> list[LeaseRenewal]:
        self.batches.append(list(attempt_ids))
        if self.down:
            raise httpx.ConnectError("All connection attempts failed")
        return [
            LeaseRenewal(id=i, lease="finished", status="succeeded", lease_expires_at=1.0)
            if i in self.finished
            else LeaseRenewal(id=i, lease="renewed", status="running", lease_expires_at=2.0)
            for i in attempt_ids
        ]

    async def complete(
        self, attempt_id: str, status: str, reward: float | None, info: dict[str, object]
    ) -> tuple[AttemptOut, bool]:
        self.completed[attempt_id] = status
        out = AttemptOut(
            id=attempt_id, rollout_id="ro", seq=1, status="failed", pool="p", claimed_at=0, lease_expires_at=0
        )
        return out, False


class _Running(ClaimingController):
    """Harnesses that run until their attempt is aborted."""

    async def execute(self, attempt: ClaimedAttempt, abort: Abort) -> Outcome:
        await abort.wait()
        return Outcome.failure(abort.reason)


def _rounds(batches: list[list[str]], size: int) -> list[list[list[str]]]:
    """The batches grouped per heartbeat interval: a round is the batches whose ids add up to `size`."""
    rounds: list[list[list[str]]] = []
    current: list[list[str]] = []
    for batch in batches:
        current.append(batch)
        if sum(map(len, current)) >= size:
            rounds.append(current)
            current = []
    return rounds


async def test_all_attempts_in_flight_are_renewed_by_one_batch_per_interval_and_a_lost_one_is_stopped() -> (
    None
):
    n = 2_500  # more than one batch holds: three requests per interval, 1,000 + 1,000 + 500 ids
    gateway = _Leases(n)
    said: list[str] = []
    controller = _Running(
        gateway,  # type: ignore[arg-type]
        "long-pool",
        parallelism=n,
        lease_seconds=60,
        heartbeat_seconds=0.05,
        log=said.append,
    )
    ids = [f"at-{i}" for i in range(n)]
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await eventually(
            lambda: controller.running == n and len(gateway.batches) >= 9, "three rounds of leases"
        )
        full = [r for r in _rounds(gateway.batches, n) if sum(map(len, r)) == n]
        assert len(full) >= 2, gateway.batches[:4]
        for one in full:
            assert [len(b) for b in one] == [MAX_HEARTBEAT_BATCH, MAX_HEARTBEAT_BATCH, 500]
            assert sorted(i for b in one for i in b) == sorted(ids), "each interval renews every attempt once"

        # A failed batch request is said and tried again at the next interval; nothing is stopped.
        gateway.down = True
        seen = len(gateway.batches)
        await eventually(lambda: len(gateway.batches) >= seen + 3, "a failing round")
        gateway.down = False
        assert controller.running == n and any(
            "heartbeat of 1000 attempts failed, retrying" in s for s in said
        )

        # The gateway says one attempt ended (someone else completed it): its harness is stopped and
        # its outcome counted as a lost lease, as a refused heartbeat always was.
        gateway.finished.add("at-7")
        await eventually(lambda: controller.failed == 1, "the attempt whose lease was lost failed")
        assert dict(controller.failed_by_reason) == {"lease lost": 1}
        assert controller.last_failure == ("at-7", "lease lost: attempt at-7 is succeeded")
        assert gateway.completed == {"at-7": "failed"}
        assert any(s == "attempt at-7: lease lost, stopping it: attempt at-7 is succeeded" for s in said)
        after = len(gateway.batches)
        await eventually(lambda: len(gateway.batches) >= after + 6, "two more rounds")
        assert all("at-7" not in b for b in gateway.batches[after + 3 :]), "a lost lease is renewed no more"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert controller.running == 0 and controller.released == n - 1
    assert controller._lease_keeper is None and controller.leases == {}, (
        "the lease keeper ends with the attempts"
    )


class _OldGateway(_Leases):
    """A gateway that predates heartbeat-batch (404): leases are renewed one request each."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.single: list[str] = []

    async def heartbeat_batch(
        self, attempt_ids: list[str], lease_seconds: float | None
    ) -> list[LeaseRenewal]:
        self.batches.append(list(attempt_ids))
        raise GatewayError(404, "Not Found")

    async def heartbeat(self, attempt_id: str, lease_seconds: float | None = None) -> None:
        self.single.append(attempt_id)
        if attempt_id in self.finished:
            raise GatewayError(409, f"attempt {attempt_id} is succeeded; its lease cannot be renewed")


async def test_a_gateway_without_batch_heartbeats_is_said_once_and_each_lease_renewed_alone() -> None:
    gateway = _OldGateway(3)
    said: list[str] = []
    controller = _Running(
        gateway,  # type: ignore[arg-type]
        "old-gateway",
        parallelism=3,
        lease_seconds=60,
        heartbeat_seconds=0.05,
        log=said.append,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        await eventually(lambda: len(gateway.single) >= 9, "three rounds of single heartbeats")
        assert len(gateway.batches) == 1, "asked once, then never again"
        assert sorted(gateway.single[:3]) == ["at-0", "at-1", "at-2"]
        assert said.count("pool old-gateway: the gateway has no batch heartbeats; one per attempt") == 1
        gateway.finished.add("at-1")
        await eventually(lambda: controller.failed == 1, "the attempt whose lease was lost failed")
        assert dict(controller.failed_by_reason) == {"lease lost": 1}
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert controller.leases == {} and controller.released == 2
