"""Hostile bodies against a real gateway on 127.0.0.1, as a careless or hostile harness would send
them: too large, too slow, not JSON any reader could give back, integers beyond 64 bits, odd keys.
Each is refused in its protocol's error format with nothing stored, and whatever is accepted can be
read back whole (claim, export)."""

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from conftest import ADMIN
from gwhelpers import FIRST_TURN, admin, calls_of, new_attempt
from testsupport import Server, gateway_server

LIMIT = 65_536
READ_TIMEOUT = 2.0
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


@pytest.fixture(scope="module")
def gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("hostile-input") / "gateway.db"
    extra = ["--max-request-bytes", str(LIMIT), "--request-read-timeout-seconds", str(READ_TIMEOUT)]
    server = gateway_server(tool_model, [engine.url], db, log_dir, admin_token=ADMIN, extra=extra).start()
    yield server
    server.stop()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": FIRST_TURN, "max_tokens": 4, **extra}


def anthropic_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


def post_raw(gw: Server, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(
        gw.url + path, content=body, headers={"content-type": "application/json", **headers}, timeout=30
    )


def key(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["type"]
    return error


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body


def rollout_count(gw: Server) -> int:
    with admin(gw) as c:
        return sum(c.get("/api/v1/progress").json()["rollouts"].values())


# --- size ------------------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_413_by_its_declared_length_or_as_it_overruns(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway)
    big = orjson.dumps(chat_body(padding="x" * LIMIT))
    r = post_raw(gateway, CHAT, big, key(attempt["token"]))
    assert assert_openai_error(r, 413)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the gateway counts as it reads
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = httpx.post(gateway.url + CHAT, content=chunks(), headers=key(attempt["token"]), timeout=30)
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413)
    r = post_raw(gateway, MESSAGES, orjson.dumps(anthropic_body(pad="x" * LIMIT)), key(attempt["token"]))
    assert_anthropic_error(r, 413, "request_too_large")
    before = rollout_count(gateway)
    with admin(gateway) as c:
        assert_openai_error(c.post("/api/v1/rollouts", json={"tasks": ["x" * LIMIT]}), 413)
    assert rollout_count(gateway) == before and calls_of(gateway, attempt["id"]) == []


def test_a_body_just_under_the_limit_is_served(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    body = orjson.dumps(chat_body(padding="x" * (LIMIT - 2048)))
    assert len(body) < LIMIT
    assert post_raw(gateway, CHAT, body, key(attempt["token"])).status_code == 200


# --- authentication before the body, slow clients --------------------------------------------------------


def open_upload(gw: Server, path: str, token: str, *, declared: int, sent: bytes = b"") -> socket.socket:
    """A request whose headers are complete and whose body is `sent` of `declared` bytes, held open."""
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body[body.index(b"{") :])


def test_an_unknown_key_is_refused_before_the_body_arrives(gateway: Server) -> None:
    sock = open_upload(gateway, CHAT, "not-a-key", declared=LIMIT - 1)  # nothing of the body sent
    status, body = read_response(sock)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    sock = open_upload(gateway, "/api/v1/rollouts", "not-the-admin-token", declared=LIMIT - 1)
    status, body = read_response(sock)
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"


def test_slow_uploads_hold_no_worker_and_end_408_after_the_read_timeout(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    partial = b'{"model": "m", "messages": ['
    stalled = [
        open_upload(gateway, CHAT, attempt["token"], declared=LIMIT - 1, sent=partial) for _ in range(32)
    ]
    for _ in range(5):  # answered while 32 uploads stall, before any of them times out
        assert httpx.get(f"{gateway.url}/healthz", timeout=READ_TIMEOUT).status_code == 200
    for sock in stalled:
        status, body = read_response(sock)
        assert status == 408 and body["error"]["code"] == "request_timeout"
    assert calls_of(gateway, attempt["id"]) == []


# --- JSON no reader could give back ------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# A JSON value each, put into an otherwise valid body of every route: the refusal is the value's.
BAD_VALUES = {
    "nan": b"NaN",
    "infinity": b"1e400",
    "lone surrogate": b'"\\ud800"',
    "invalid utf-8": b'"\xff\xfe"',
    "deep nesting": nested(200),
    "integer beyond 64 bits": b"18446744073709551616",
    "negative integer beyond 64 bits": b"-9223372036854775809",
    "unsigned 64-bit integer": b"9223372036854775808",
    "huge integer literal": b"1" + b"0" * 5000,
    "not json": b"=m",
    "truncated": b"[",
}
BODIES = {
    CHAT: b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "x": %s}',
    "/v1/responses": b'{"model": "m", "input": "hi", "max_output_tokens": 4, "x": %s}',
    "/v1/inharness/reward": b'{"reward": 1, "x": %s}',
    MESSAGES: b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "x": %s}',
}


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_json_that_no_reader_could_give_back_is_refused_400_on_every_route(
    gateway: Server, value: bytes
) -> None:
    attempt = new_attempt(gateway)
    for path, body in BODIES.items():
        r = post_raw(gateway, path, body % value, key(attempt["token"]))
        if path == MESSAGES:
            assert_anthropic_error(r, 400, "invalid_request_error")
            assert r.json()["error"]["message"].startswith("the request body"), r.text
        else:
            assert assert_openai_error(r, 400)["code"] == "invalid_json"
    before = rollout_count(gateway)
    r = post_raw(gateway, "/api/v1/rollouts", b'{"tasks": [%s]}' % value, key(ADMIN))
    assert assert_openai_error(r, 400)["code"] == "invalid_json"
    assert rollout_count(gateway) == before and calls_of(gateway, attempt["id"]) == []
    with admin(gateway) as c:
        assert c.get(f"/api/v1/attempts/{attempt['id']}/posted-reward").json()["posted"] is None


TYPED_OUT_OF_RANGE = {
    "seed beyond int64": {"seed": 2**63 - 1 + 1},
    "seed as a huge float": {"seed": 1.8446744073709552e19},
    "max_tokens as a huge float": {"max_tokens": 1e30},
}


@pytest.mark.parametrize("extra", TYPED_OUT_OF_RANGE.values(), ids=TYPED_OUT_OF_RANGE.keys())
def test_typed_integers_beyond_64_bits_are_refused_400_not_500(
    gateway: Server, extra: dict[str, Any]
) -> None:
    attempt = new_attempt(gateway)
    r = post_raw(gateway, CHAT, orjson.dumps(chat_body(**extra)), key(attempt["token"]))
    assert_openai_error(r, 400)
    assert calls_of(gateway, attempt["id"]) == []


def test_a_temperature_next_to_zero_is_greedy_not_an_engine_error(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    r = post_raw(gateway, CHAT, orjson.dumps(chat_body(temperature=1e-300)), key(attempt["token"]))
    assert r.status_code == 200, r.text
    assert len(calls_of(gateway, attempt["id"])) == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/attempts/claim", b'{"lease_seconds": true}', "lease_seconds"),
        ("/api/v1/attempts/claim-batch", b'{"lease_seconds": true, "limit": 1}', "lease_seconds"),
        ("/api/v1/attempts/claim-batch", b'{"limit": "1"}', "limit"),
        (
            "/api/v1/attempts/heartbeat-batch",
            b'{"attempt_ids": ["a"], "lease_seconds": true}',
            "lease_seconds",
        ),
        ("/api/v1/rollouts", b'{"tasks": [1], "group_size": 1.0}', "group_size"),
        ("/api/v1/models/versions", b'{"version": 9.3e18, "engines": ["http://127.0.0.1:1"]}', "version"),
        ("/api/v1/progress", b'{"step": 1, "total_steps": 2, "reward_mean": 1e400}', None),
        ("/api/v1/progress", b'{"step": true, "total_steps": 2}', "step"),
        ("/api/v1/serving/pause", b'{"hold_seconds": true}', "hold_seconds"),
    ],
)
def test_control_values_of_another_type_or_out_of_range_are_refused_400(
    gateway: Server, path: str, body: bytes, field: str | None
) -> None:
    r = post_raw(gateway, path, body, key(ADMIN))
    error = assert_openai_error(r, 400)
    assert error["param"] == field, error
    with admin(gateway) as c:
        assert c.get("/api/v1/serving").json()["paused"] is False


def test_a_completion_with_a_non_finite_reward_is_refused_and_the_attempt_still_runs(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    path = f"/api/v1/attempts/{attempt['id']}"
    for raw in (b'{"status": "succeeded", "reward": NaN}', b'{"status": "succeeded", "reward": -1e999}'):
        assert assert_openai_error(post_raw(gateway, f"{path}/complete", raw, key(ADMIN)), 400)["code"] == (
            "invalid_json"
        )
    r = post_raw(gateway, f"{path}/heartbeat", b'{"lease_seconds": true}', key(ADMIN))
    assert assert_openai_error(r, 400)["param"] == "lease_seconds"
    with admin(gateway) as c:
        assert c.post(f"{path}/heartbeat", json={}).json()["status"] == "running"


# --- what is accepted is given back ----------------------------------------------------------------------


def deep(levels: int) -> Any:
    value: Any = "deep"
    for _ in range(levels):
        value = [value]
    return value


EXTREMES: list[Any] = [
    2**63 - 1,
    -(2**63),
    1e300,
    -0.0,
    "astral \U0001f600, \u2028 and \x00",
    deep(120),
    {"": None, "k" * 1000: [True, False]},
]


def test_values_at_the_limits_are_stored_and_come_back_whole_through_claim_and_export(
    gateway: Server,
) -> None:
    task = {"values": EXTREMES}
    with admin(gateway) as c:
        r = c.post("/api/v1/rollouts", json={"tasks": [task], "pool": "extremes"})
        assert r.status_code == 201, r.text
        claimed = c.post("/api/v1/attempts/claim", json={"pool": "extremes"}).json()["attempt"]
        assert claimed["task"] == task
        done = c.post(f"/api/v1/attempts/{claimed['id']}/complete", json={"status": "succeeded", "reward": 1})
        assert done.status_code == 200, done.text
        r = c.get("/api/v1/export/rollouts", params={"limit": 100_000})
    assert r.status_code == 200
    exported = [orjson.loads(line) for line in r.content.splitlines()]
    assert task in [e["rollout"]["task"] for e in exported]


# --- odd keys --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix",
    ["%00", "%F0%9F%98%80", "..%2F..%2Fapi", "%ZZ", "a" * 8192, "%C3%28", "Bearer%20x", "%0D%0AX:%201"],
)
def test_an_odd_key_in_the_path_is_refused_401_in_the_protocols_format(gateway: Server, prefix: str) -> None:
    r = post_raw(gateway, f"/t/{prefix}{CHAT}", orjson.dumps(chat_body()), {})
    assert r.status_code in (401, 404), r.text
    assert "error" in r.json()
    r = post_raw(gateway, f"/t/{prefix}{MESSAGES}", orjson.dumps(anthropic_body()), {})
    assert r.status_code in (401, 404), r.text
    if r.status_code == 401:
        assert_anthropic_error(r, 401, "authentication_error")


async def test_concurrent_hostile_bodies_leave_the_gateway_serving(gateway: Server) -> None:
    attempt = new_attempt(gateway)

    async def hostile(h: httpx.AsyncClient, body: bytes) -> int:
        r = await h.post(
            CHAT, content=body, headers={**key(attempt["token"]), "content-type": "application/json"}
        )
        return r.status_code

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as h:
        bodies = [BODIES[CHAT] % v for v in BAD_VALUES.values()] * 4
        statuses = await asyncio.gather(*(hostile(h, b) for b in bodies))
        assert set(statuses) == {400}
        assert (await h.get("/healthz")).status_code == 200


# --- cursors past 64 bits --------------------------------------------------------------------------------


@pytest.mark.parametrize("after", [2**63, 91135674627371472781312])
def test_an_export_cursor_past_64_bits_is_refused_naming_it_before_any_line(
    gateway: Server, after: int
) -> None:
    """An outside fuzzer's find: the store cannot hold such a cursor, and a 200 that then breaks off
    mid-stream looks to a reader like a cut connection; the bound is checked before the first byte."""
    with admin(gateway) as c:
        r = c.get("/api/v1/export/rollouts", params={"after": after})
        last = c.get("/api/v1/export/rollouts", params={"after": 2**63 - 1})
    assert r.status_code == 400, r.text  # the gateway's answer to every invalid parameter
    assert r.json()["error"]["param"] == "query.after"
    assert last.status_code == 200 and last.content == b""


@pytest.mark.parametrize(
    ("method", "path", "param"),
    [
        ("GET", "/api/v1/rollouts/" + "r" * 65, "path.rollout_id"),
        ("GET", "/api/v1/attempts/" + "a" * 65 + "/calls", "path.attempt_id"),
        ("POST", "/api/v1/attempts/" + "a" * 65 + "/heartbeat", "path.attempt_id"),
        ("POST", "/api/v1/pools/" + "p" * 254 + "/release-running", "path.pool"),
    ],
)
def test_a_path_id_past_its_bound_is_refused_naming_it(
    gateway: Server, method: str, path: str, param: str
) -> None:
    """The bounds the OpenAPI document states (test_routes_documented) are the ones enforced."""
    with admin(gateway) as c:
        r = c.request(method, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_id_past_its_bound_in_a_list_is_refused_naming_it(gateway: Server) -> None:
    with admin(gateway) as c:
        r = c.post("/api/v1/rollouts/hold", json={"ids": ["ro-1", "r" * 65]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "ids.1"
