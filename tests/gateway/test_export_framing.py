"""How the export ends: whole, refused before its first byte, or broken off where a client can tell.

The gateway runs in this process (a real uvicorn server with the gateway's own HTTP protocol, on
127.0.0.1) so that its store can be made to fail on a later page: `FailingPages` wraps the real SQLite
store's `export` and raises from its second call, the one fault here that a real store does not produce
on demand."""

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from conftest import ADMIN

from inharness.gateway.app import _head_deadline_protocol, create_app
from inharness.gateway.client import GatewayClient, GatewayError
from inharness.gateway.settings import GatewaySettings

ROLLOUTS = 3


class FailingPages:
    """The store's `export`, failing from call `fail_from` on (0: never), counting calls."""

    def __init__(self, export: Any) -> None:
        self.export, self.calls, self.fail_from = export, 0, 0

    async def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.fail_from and self.calls >= self.fail_from:
            raise OSError("disk I/O error (injected)")
        return await self.export(**kwargs)


class InProcessGateway:
    def __init__(self, tiny_model: Path, db: Path) -> None:
        settings = GatewaySettings(model=str(tiny_model), store=f"sqlite:///{db}", admin_token=ADMIN)
        self.app = create_app(settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        http = _head_deadline_protocol(settings.request_head_timeout_seconds, settings.request_head_max_bytes)
        config = uvicorn.Config(self.app, log_level="critical", access_log=False, http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "InProcessGateway":
        self.thread.start()
        while not self.server.started:  # bounded by the thread: a failed start ends it
            assert self.thread.is_alive(), "the gateway did not start"
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def gw(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessGateway, Any]]:
    with InProcessGateway(tiny_model, tmp_path_factory.mktemp("export") / "gateway.db") as gateway:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            tasks = [{"n": i} for i in range(ROLLOUTS)]
            assert c.post("/api/v1/rollouts", json={"tasks": tasks}).status_code == 201
            for _ in range(ROLLOUTS):
                attempt = c.post("/api/v1/attempts/claim", json={"lease_seconds": 600}).json()["attempt"]
                done = {"status": "succeeded", "reward": 1.0}
                assert c.post(f"/api/v1/attempts/{attempt['id']}/complete", json=done).status_code == 200
        pages = FailingPages(gateway.app.state.store.export)
        gateway.app.state.store.export = pages
        yield gateway, pages


def _get(url: str, **params: Any) -> tuple[int, bytes, str | None]:
    """(status, the bytes received, why the body was incomplete or None) of one export request."""
    got = b""
    with httpx.stream(
        "GET", f"{url}/api/v1/export/rollouts", params=params, headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        try:
            for chunk in r.iter_raw():
                got += chunk
        except httpx.RemoteProtocolError as exc:
            return r.status_code, got, str(exc)
    return r.status_code, got, None


def test_a_whole_export_ends_with_its_last_chunk(gw: tuple[InProcessGateway, Any]) -> None:
    gateway, pages = gw
    pages.fail_from = 0
    status, body, broken = _get(gateway.url, page=1)
    assert (status, broken) == (200, None)
    assert [orjson.loads(x)["cursor"] for x in body.splitlines()] == [1, 2, 3]


@pytest.mark.parametrize(
    ("param", "value"),
    [("after", 91135674627371472781312), ("after", -1), ("limit", 0), ("limit", 10**30), ("page", 1001)],
)
def test_a_parameter_out_of_bounds_is_refused_whole_before_the_store_is_read(
    gw: tuple[InProcessGateway, Any], param: str, value: int
) -> None:
    gateway, pages = gw
    before = pages.calls
    status, body, broken = _get(gateway.url, **{param: value})
    assert (status, broken) == (400, None)
    assert orjson.loads(body)["error"]["param"] == f"query.{param}"
    assert pages.calls == before


def test_a_store_failing_on_the_first_page_is_a_whole_500(gw: tuple[InProcessGateway, Any]) -> None:
    gateway, pages = gw
    pages.fail_from = pages.calls + 1
    status, body, broken = _get(gateway.url, page=1)
    assert (status, broken) == (500, None)
    assert orjson.loads(body)["error"]["type"] == "server_error"


def test_an_export_broken_off_after_its_first_line_says_so_and_ends_unterminated(
    gw: tuple[InProcessGateway, Any],
) -> None:
    gateway, pages = gw
    pages.fail_from = pages.calls + 2  # the first page is read, the second fails
    status, body, broken = _get(gateway.url, page=1)
    assert status == 200 and broken is not None and "incomplete chunked read" in broken
    first, last = body.splitlines()
    assert orjson.loads(first)["cursor"] == 1
    error = orjson.loads(last)["error"]
    assert error["code"] == "export_failed" and error["cursor"] == 1 and "cursor 1" in error["message"]


def test_the_client_raises_for_an_export_that_broke_off(gw: tuple[InProcessGateway, Any]) -> None:
    """Never a shorter iteration that looks complete: the lines before the break, then the error."""
    gateway, pages = gw
    got: list[int] = []

    async def read() -> None:
        async with GatewayClient(gateway.url, ADMIN) as client:
            async for item in client.export(page=1):
                got.append(item.cursor)

    pages.fail_from = pages.calls + 3  # two pages, then the failure
    with pytest.raises(GatewayError) as err:
        asyncio.run(read())
    assert err.value.code == "export_failed" and got == [1, 2]
