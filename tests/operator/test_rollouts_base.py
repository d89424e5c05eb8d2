"""The one retry policy of the rollout controllers (rollouts/base.py): tries doubling their wait,
transient errors retried, others and the last one raised."""

import asyncio

import httpx
import pytest

from inharness.gateway.client import GatewayError
from inharness.operator.rollouts.base import backoff, gateway_transient, retry


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
