"""The gateway client across a gateway that dies mid-request: a request the gateway dropped before
answering is sent again only when applying it twice means the same as once (reads and the requests
marked idempotent); a claim without a `claim_key` is not (it could start a second attempt), and fails
(a keyed one is repeated: test_attempt_api.py).

The "gateway" here is a raw asyncio server on 127.0.0.1 that reads each request whole and closes the
first `drop` connections without a word, as a gateway killed between reading and answering does; then
it answers like the gateway's serving and claim routes."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest

from inharness.gateway.client import GatewayClient

SERVING = orjson.dumps({"paused": False, "in_flight": 0, "held": 0, "resumes_at": None})


@asynccontextmanager
async def dying_gateway(drop: int) -> AsyncIterator[tuple[str, list[str]]]:
    """(its URL, the request lines it read, dropped ones included)."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next((int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length:")), 0)
        await reader.readexactly(length)
        seen.append(lines[0])
        if len(seen) > drop:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (len(SERVING), SERVING)
            )
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


def test_an_idempotent_request_the_gateway_dropped_is_sent_again() -> None:
    async def main() -> list[str]:
        async with (
            dying_gateway(drop=2) as (url, seen),
            GatewayClient(url, "admin", connect_retry_seconds=10) as gw,
        ):
            state = await gw.resume()
            assert not state.paused
            return seen

    assert asyncio.run(main()) == ["POST /api/v1/serving/resume HTTP/1.1"] * 3


def test_a_claim_the_gateway_dropped_is_not_sent_again() -> None:
    async def main() -> list[str]:
        async with (
            dying_gateway(drop=1) as (url, seen),
            GatewayClient(url, "admin", connect_retry_seconds=10) as gw,
        ):
            with pytest.raises(httpx.RemoteProtocolError):
                await gw.claim("default", 60)
            return seen

    assert asyncio.run(main()) == ["POST /api/v1/attempts/claim HTTP/1.1"]


def test_without_a_retry_window_a_dropped_request_fails_at_once() -> None:
    async def main() -> list[str]:
        async with dying_gateway(drop=1) as (url, seen), GatewayClient(url, "admin") as gw:
            with pytest.raises(httpx.RemoteProtocolError):
                await gw.serving()
            return seen

    assert asyncio.run(main()) == ["GET /api/v1/serving HTTP/1.1"]
