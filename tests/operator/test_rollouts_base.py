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
from inharness.gateway.schema import ClaimedAttempt
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

    async def claim(self, pool: str, lease_seconds: float) -> None:
        self.claims.append(time.monotonic())
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
        gateway.up = True
        await eventually(lambda: controller.claim_trouble is None, "claims pass again", within=5)
        assert said == [said[0]] and said[0].startswith("pool calc-pool: claiming again after")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
