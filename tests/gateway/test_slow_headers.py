"""Slow request heads (slowloris) against a real gateway on 127.0.0.1, over raw sockets: a client that
sends its request line and headers byte by byte, or nothing at all, is answered 408 and closed once
`--request-head-timeout-seconds` pass, and frees what it held; a keep-alive client whose heads arrive
in pieces within the deadline, however long it idles between requests, is served; a body keeps its own
deadline (`--request-read-timeout-seconds`), which the head's does not cut short."""

import asyncio
import contextlib
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import ADMIN
from gwhelpers import FIRST_TURN, new_attempt
from testsupport import Server, eventually, gateway_server

HEAD_TIMEOUT = 1.0
READ_TIMEOUT = 3.0
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
IDLE_SOCKETS: dict[int, int] = {}  # the gateway's open sockets with no client connected, by port


@pytest.fixture(scope="module")
def gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("slow-headers") / "gateway.db"
    extra = [
        f"--request-head-timeout-seconds={HEAD_TIMEOUT}",
        f"--request-read-timeout-seconds={READ_TIMEOUT}",
    ]
    server = gateway_server(tool_model, [engine.url], db, log_dir, admin_token=ADMIN, extra=extra).start()
    IDLE_SOCKETS[server.port] = open_sockets(server)  # listening, engine and store: no client yet
    yield server
    server.stop()


def connect(gw: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response off a keep-alive connection: its status and body (by its content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {data!r}"
        body += chunk
    return int(head.split()[1]), body


def dribble(sock: socket.socket, within: float) -> tuple[bytes, float | None]:
    """Send a header, one byte every 0.1 s, until the gateway answers and closes or `within` s pass:
    what it sent back, and after how many seconds it closed (None if it never did)."""
    start, got = time.monotonic(), b""
    sock.sendall(b"X-Slow: ")
    while (elapsed := time.monotonic() - start) < within:
        if select.select([sock], [], [], 0.1)[0]:
            chunk = b""
            with contextlib.suppress(ConnectionResetError):
                chunk = sock.recv(65536)
            if not chunk:
                return got, elapsed
            got += chunk
        else:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed: the read says so
                sock.send(b"a")
    return got, None


def open_sockets(gw: Server) -> int:
    """The gateway process's open sockets (listening, engine and store connections included)."""
    assert gw.proc is not None
    count = 0
    for fd in Path(f"/proc/{gw.proc.pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            count += os.readlink(fd).startswith("socket:")
    return count


def test_a_dribbled_head_is_answered_408_and_closed_at_the_deadline(gateway: Server) -> None:
    sock = connect(gateway)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    got, closed_after = dribble(sock, within=HEAD_TIMEOUT * 30)
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert b"connection: close" in got and b"did not arrive within 1 s" in got
    assert closed_after is not None and closed_after >= HEAD_TIMEOUT * 0.9  # closed, and not early


def test_a_head_over_the_size_bound_is_answered_431_and_closed_at_once(gateway: Server) -> None:
    """Within the deadline a head could grow without bound (httptools keeps all of it)."""
    got = b""
    with connect(gateway) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed while the rest is sent
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Big: " + b"a" * 200_000)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                got += chunk
    # a 431, not the 408 the head's deadline would have given: refused as soon as it was too large
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert b"over 65536 bytes" in got


def test_a_head_within_the_size_bound_and_a_large_body_after_it_are_served(gateway: Server) -> None:
    """The bound counts the head only: a head near it is served, and so is a body far above it that
    arrives in the same packets as its head."""
    with connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n")
        assert read_response(sock)[0] == 200
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}]})
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        status, _ = read_response(sock)
        assert status == 401  # no key: answered by the route, not refused as a large head


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(gateway: Server) -> None:
    sock = connect(gateway)
    start = time.monotonic()
    got = sock.recv(65536)
    assert got.startswith(b"HTTP/1.1 408 ") and sock.recv(65536) == b""
    assert time.monotonic() - start >= HEAD_TIMEOUT * 0.9  # not before the deadline


def test_a_head_dribbled_after_a_response_on_a_kept_alive_connection_is_closed_at_the_deadline(
    gateway: Server,
) -> None:
    """uvicorn's keep-alive timeout stops at the first byte of the next request: the head's deadline
    takes over from there."""
    sock = connect(gateway)
    sock.sendall(HEALTH)
    assert read_response(sock)[0] == 200
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    got, closed_after = dribble(sock, within=HEAD_TIMEOUT * 30)
    assert got.startswith(b"HTTP/1.1 408 ") and closed_after is not None


def test_a_keep_alive_client_whose_heads_arrive_in_pieces_within_the_deadline_is_served(
    gateway: Server,
) -> None:
    """Four requests on one connection over about 5 deadlines: each head takes 0.6 deadlines in two
    pieces, and the connection idles 0.8 deadlines between a response and the next head."""
    sock = connect(gateway)
    for _ in range(4):
        sock.sendall(HEALTH[:20])
        time.sleep(HEAD_TIMEOUT * 0.6)
        sock.sendall(HEALTH[20:])
        status, body = read_response(sock)
        assert status == 200 and orjson.loads(body) == {"status": "ok"}, body
        time.sleep(HEAD_TIMEOUT * 0.8)
    sock.sendall(HEALTH)
    assert read_response(sock)[0] == 200


def test_many_stalled_heads_do_not_stop_normal_calls_and_are_freed_at_the_deadline(
    gateway: Server,
) -> None:
    # the connections of earlier tests, closed by their clients, may still be closing on the gateway's side
    idle = IDLE_SOCKETS[gateway.port]
    asyncio.run(eventually(lambda: open_sockets(gateway) <= idle, "earlier tests' sockets closed"))
    before = open_sockets(gateway)
    stalled = [connect(gateway) for _ in range(200)]
    for sock in stalled:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    start = time.monotonic()
    with httpx.Client(base_url=gateway.url, timeout=HEAD_TIMEOUT) as http:
        while time.monotonic() - start < HEAD_TIMEOUT / 2:  # answered while all 200 stall
            assert http.get("/healthz").status_code == 200
    assert open_sockets(gateway) >= before + 200  # each held its socket meanwhile
    for sock in stalled:
        sock.settimeout(HEAD_TIMEOUT * 30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 408 ") and sock.recv(65536) == b""
        sock.close()
    asyncio.run(eventually(lambda: open_sockets(gateway) <= before, "the stalled sockets closed"))


def test_a_body_keeps_its_own_deadline_past_the_heads(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    body = orjson.dumps({"model": "m", "messages": FIRST_TURN, "max_tokens": 4})
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {attempt['token']}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()

    slow = connect(gateway)  # its body in three pieces over 1.2 head deadlines: served
    slow.sendall(head)
    for piece in (body[:10], body[10:20], body[20:]):
        slow.sendall(piece)
        time.sleep(HEAD_TIMEOUT * 0.4)
    status, answer = read_response(slow)
    assert status == 200, answer

    stalled = connect(gateway)  # half its body, then nothing: 408 after the read timeout
    stalled.sendall(head + body[: len(body) // 2])
    start = time.monotonic()
    status, answer = read_response(stalled)
    assert status == 408 and orjson.loads(answer)["error"]["code"] == "request_timeout", answer
    assert time.monotonic() - start >= READ_TIMEOUT * 0.9  # not before the read deadline
