"""Keys against a real gateway on 127.0.0.1: an attempt's key reaches its own attempt's routes and
nothing else, the admin token only the control API, a key stops the moment its lease passes (however
the lease was moved), and a call is recorded only when its harness can have received the answer (a cut
stream as far as it was sent) while its attempt still ran (docs/gateway.md, "What is recorded")."""

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from conftest import ADMIN
from gwhelpers import FIRST_TURN, admin, calls_of, finish, new_attempt, serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from testsupport import Server, eventually, gateway_server

from inharness.gateway.schema import ExportedRollout
from inharness.procs import free_port
from inharness.trainer.samples import build_samples

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    yield from serve(engine, tool_model, tmp_path_factory, log_dir)


def chat(gw: Server, token: str, **headers: str) -> httpx.Response:
    body = {"model": "m", "messages": FIRST_TURN, "max_tokens": 4}
    return httpx.post(
        gw.url + CHAT, json=body, headers={"Authorization": f"Bearer {token}", **headers}, timeout=60
    )


def dropped(gw: Server, reason: str) -> float:
    text = httpx.get(f"{gw.url}/metrics").text
    found = re.search(rf'^inharness_gateway_calls_dropped_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def control_routes(gw: Server) -> list[tuple[str, str]]:
    paths = httpx.get(f"{gw.url}/openapi.json").json()["paths"]
    return [(m.upper(), p) for p, ops in paths.items() if p.startswith("/api/v1/") for m in ops]


def test_an_attempts_key_reaches_no_route_of_the_control_api(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    routes = control_routes(gateway)
    assert len(routes) >= 20
    ids = {"attempt_id": attempt["id"], "rollout_id": attempt["rollout_id"], "pool": "default"}
    with httpx.Client(base_url=gateway.url, timeout=30) as h:
        for method, path in routes:
            url = re.sub(r"{(\w+)}", lambda m: ids[m.group(1)], path)
            for headers in ({"Authorization": f"Bearer {attempt['token']}"}, {"x-api-key": attempt["token"]}):
                r = h.request(method, url, json={}, headers=headers)
                assert r.status_code == 401, (method, url, r.text)
                assert r.json()["error"]["code"] == "invalid_admin_token"
            r = h.request(method, f"/t/{attempt['token']}{url}", json={})
            assert r.status_code in (404, 405), (method, url, r.text)


def test_the_admin_token_is_no_attempts_key(gateway: Server) -> None:
    r = chat(gateway, ADMIN)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{gateway.url}/t/{ADMIN}/v1/inharness/reward", json={"reward": 1.0})
    assert r.status_code == 401


@pytest.mark.parametrize(
    "token",
    [ADMIN[:-1] + chr(ord(ADMIN[-1]) + 1), ADMIN[:-1], ADMIN + "x", "", ADMIN.upper(), "é" * len(ADMIN)],
    ids=["last char", "prefix", "longer", "empty", "case", "non-ascii"],
)
def test_only_the_exact_admin_token_opens_the_control_api(gateway: Server, token: str) -> None:
    header = f"Bearer {token}".strip().encode()  # bytes: a client may send any latin-1 header
    r = httpx.get(f"{gateway.url}/api/v1/serving", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"


def test_a_key_posts_and_reads_only_its_own_attempts_reward(gateway: Server) -> None:
    a, b = new_attempt(gateway), new_attempt(gateway)
    r = httpx.post(
        f"{gateway.url}/t/{a['token']}/v1/inharness/reward",
        json={"reward": 0.25},
        headers={"Authorization": f"Bearer {b['token']}"},  # the path's key is the one used
    )
    assert r.status_code == 200 and r.json()["attempt_id"] == a["id"]
    assert chat(gateway, a["token"]).status_code == 200
    with admin(gateway) as c:
        posted = {
            x["id"]: c.get(f"/api/v1/attempts/{x['id']}/posted-reward").json()["posted"] for x in (a, b)
        }
    assert posted[a["id"]]["reward"] == 0.25 and posted[b["id"]] is None
    assert len(calls_of(gateway, a["id"])) == 1 and calls_of(gateway, b["id"]) == []


async def test_a_key_stops_once_a_lease_shortened_by_a_heartbeat_passes_and_nothing_more_is_recorded(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway, lease=600)
    assert chat(gateway, attempt["token"]).status_code == 200  # the key is now in the gateway's cache
    with admin(gateway) as c:
        r = c.post(f"/api/v1/attempts/{attempt['id']}/heartbeat", json={"lease_seconds": 0.2})
        assert r.status_code == 200, r.text

        def requeued() -> bool:
            rollout = c.get(f"/api/v1/rollouts/{attempt['rollout_id']}").json()
            return (
                rollout["status"] == "queued" and rollout["attempts"][0]["failure_reason"] == "lease expired"
            )

        await eventually(requeued, "the lease expired and the rollout was requeued", within=30)
    r = chat(gateway, attempt["token"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "attempt_finished", r.text
    assert len(calls_of(gateway, attempt["id"])) == 1


async def held_call(gw: Server, token: str) -> tuple[asyncio.Task[httpx.Response], httpx.AsyncClient]:
    """A chat call started while serving is paused, once the gateway holds it."""
    client = httpx.AsyncClient(base_url=gw.url, timeout=60)
    body = {"model": "m", "messages": FIRST_TURN, "max_tokens": 4}
    task = asyncio.create_task(client.post(CHAT, json=body, headers={"Authorization": f"Bearer {token}"}))
    with admin(gw) as c:
        await eventually(lambda: c.get("/api/v1/serving").json()["held"] == 1, "the call is held")
    return task, client


def serving(gw: Server, action: str, **body: Any) -> None:
    with admin(gw) as c:
        assert c.post(f"/api/v1/serving/{action}", json=body).status_code == 200


async def test_a_call_held_while_its_attempt_completes_is_answered_403_and_not_recorded(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway)
    before = dropped(gateway, "attempt_ended")
    serving(gateway, "pause", hold_seconds=60)
    try:
        task, client = await held_call(gateway, attempt["token"])
        with admin(gateway) as c:
            r = c.post(
                f"/api/v1/attempts/{attempt['id']}/complete", json={"status": "succeeded", "reward": 1}
            )
            assert r.json()["attempt"]["calls"] == 0
    finally:
        serving(gateway, "resume")
    r = await task
    await client.aclose()
    assert r.status_code == 403 and r.json()["error"]["code"] == "attempt_finished", r.text
    assert calls_of(gateway, attempt["id"]) == []
    assert dropped(gateway, "attempt_ended") == before + 1


async def test_a_client_that_leaves_during_a_pause_gets_nothing_generated_or_recorded(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway)
    before = dropped(gateway, "client_gone")
    serving(gateway, "pause", hold_seconds=60)
    try:
        task, client = await held_call(gateway, attempt["token"])
        task.cancel()
        await client.aclose()  # the connection closes: the harness gave up
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        serving(gateway, "resume")
    await eventually(
        lambda: dropped(gateway, "client_gone") == before + 1, "the left call counted as dropped"
    )
    assert calls_of(gateway, attempt["id"]) == []
    assert chat(gateway, attempt["token"]).status_code == 200  # the key still serves its attempt
    assert len(calls_of(gateway, attempt["id"])) == 1


# --- calls in flight: a gated engine holds each answer until the test lets it go -----------------------


class Gate:
    """Holds the engine's answers: `entered` is set when a request reaches it, and it answers (plain)
    or sends its last chunk (streamed) once `open` is set; a stream sends its tokens once `tokens` is
    set (at once, unless a test clears it). `left` is set when a stream's reader hung up on the engine
    before its last chunk."""

    def __init__(self) -> None:
        self.open, self.entered = threading.Event(), threading.Event()
        self.tokens, self.left = threading.Event(), threading.Event()
        self.tokens.set()

    def close(self) -> None:
        self.open.clear()
        self.entered.clear()
        self.left.clear()


def gated_engine(reply: list[int], gate: Gate) -> Starlette:
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        ids = reply[: int(body["max_tokens"])]
        choice = {"index": 0, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}
        gate.entered.set()
        if not body.get("stream"):
            await asyncio.to_thread(gate.open.wait, 60)
            return Response(orjson.dumps({"choices": [{**choice, "finish_reason": "stop"}]}))

        async def events() -> Any:
            finished = False
            try:
                await asyncio.to_thread(gate.tokens.wait, 60)
                yield b"data: " + orjson.dumps({"choices": [{**choice, "finish_reason": None}]}) + b"\n\n"
                await asyncio.to_thread(gate.open.wait, 60)
                done = {
                    **choice,
                    "token_ids": [],
                    "logprobs": {"token_logprobs": []},
                    "finish_reason": "stop",
                }
                yield b"data: " + orjson.dumps({"choices": [done]}) + b"\n\n"
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    gate.left.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return Response(b"{}")

    async def models(_: Request) -> Response:
        return Response(b'{"data": [{"id": "gated"}]}')

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=[*routes, Route("/v1/models", models)])


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate()


@pytest.fixture(scope="module")
def gated(
    gate: Gate, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    """A gateway in front of the gated engine (a real server on 127.0.0.1, in a thread)."""
    from transformers import AutoTokenizer

    reply = AutoTokenizer.from_pretrained(tiny_model).encode("Five.", add_special_tokens=False)
    port = free_port()
    engine = uvicorn.Server(uvicorn.Config(gated_engine(reply, gate), port=port, log_level="warning"))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    while not engine.started:  # bounded by the thread: a failed start ends it
        assert thread.is_alive(), "the gated engine did not start"
        time.sleep(0.01)
    gate.open.set()  # open while the gateway checks the engine
    db = tmp_path_factory.mktemp("hostile-keys-gated") / "gateway.db"
    server = gateway_server(tiny_model, [f"http://127.0.0.1:{port}"], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()
    gate.open.set()
    engine.should_exit = True
    thread.join(10)


async def in_flight(
    gw: Server, gate: Gate, token: str
) -> tuple[asyncio.Task[httpx.Response], httpx.AsyncClient]:
    """A plain chat call that has reached the engine, whose answer the gate holds."""
    gate.close()
    client = httpx.AsyncClient(base_url=gw.url, timeout=60)
    body = {"model": "m", "messages": FIRST_TURN, "max_tokens": 4}
    task = asyncio.create_task(client.post(CHAT, json=body, headers={"Authorization": f"Bearer {token}"}))
    await eventually(gate.entered.is_set, "the call reached the engine")
    return task, client


async def test_a_plain_call_whose_client_left_during_generation_is_not_recorded(
    gated: Server, gate: Gate
) -> None:
    attempt = new_attempt(gated)
    before = dropped(gated, "client_gone")
    task, client = await in_flight(gated, gate, attempt["token"])
    task.cancel()
    await client.aclose()  # the harness timed out and hung up
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.open.set()
    await eventually(
        lambda: dropped(gated, "client_gone") == before + 1, "the unheard answer counted as dropped"
    )
    assert calls_of(gated, attempt["id"]) == []
    assert chat(gated, attempt["token"]).status_code == 200  # a call whose client stays is recorded
    assert len(calls_of(gated, attempt["id"])) == 1


async def test_a_call_in_flight_when_its_attempt_completes_is_answered_403_and_not_recorded(
    gated: Server, gate: Gate
) -> None:
    attempt = new_attempt(gated)
    before = dropped(gated, "attempt_ended")
    task, client = await in_flight(gated, gate, attempt["token"])
    with admin(gated) as c:
        r = c.post(f"/api/v1/attempts/{attempt['id']}/complete", json={"status": "succeeded", "reward": 1})
        assert r.json()["attempt"]["calls"] == 0
    gate.open.set()
    r = await task
    await client.aclose()
    assert r.status_code == 403 and r.json()["error"]["code"] == "attempt_finished", r.text
    assert calls_of(gated, attempt["id"]) == []
    assert dropped(gated, "attempt_ended") == before + 1


# Each protocol's streamed request and the mark of an event that carries generated text.
STREAMS = {
    "chat": (CHAT, {"messages": FIRST_TURN, "max_tokens": 8}, '"content":"'),
    "responses": ("/v1/responses", {"input": FIRST_TURN, "max_output_tokens": 8}, "output_text.delta"),
    "messages": (
        "/v1/messages",
        {"messages": FIRST_TURN[1:], "system": FIRST_TURN[0]["content"], "max_tokens": 8},
        "text_delta",
    ),
}


async def cut_stream(gw: Server, protocol: str, token: str, *, after: str | None) -> None:
    """A streamed call in `protocol` whose client hangs up on the first line holding `after` (None: on
    the first event), as a harness that gives up mid-answer (LiteLLM's repetition guard, a Ctrl-C)."""
    path, body, _ = STREAMS[protocol]
    headers = {"Authorization": f"Bearer {token}", "x-api-key": token, "anthropic-version": "2023-06-01"}
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=60) as client,
        client.stream("POST", path, json={"model": "m", **body, "stream": True}, headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:") and (after is None or (after in line and '"content":""' not in line)):
                return


@pytest.mark.parametrize("protocol", list(STREAMS))
async def test_a_stream_cut_off_after_tokens_were_sent_is_recorded_as_client_cut_and_the_engine_stops(
    gated: Server, gate: Gate, protocol: str
) -> None:
    attempt = new_attempt(gated)
    before = dropped(gated, "client_gone")
    gate.close()
    await cut_stream(gated, protocol, attempt["token"], after=STREAMS[protocol][2])
    await eventually(lambda: len(calls_of(gated, attempt["id"])) == 1, "the cut call recorded")
    await eventually(gate.left.is_set, "the gateway hung up on the engine's stream")
    gate.open.set()
    (cut,) = calls_of(gated, attempt["id"])
    assert cut["finish_reason"] == "client_cut"
    assert cut["response_ids"] and cut["response_logprobs"] == [-0.5] * len(cut["response_ids"])
    assert dropped(gated, "client_gone") == before

    # The harness goes on with what it was shown: the next call extends the cut one, and the trainer
    # learns both answers in one sample under the attempt's reward.
    history = [*FIRST_TURN, {"role": "assistant", "content": "Five."}, {"role": "user", "content": "Go on."}]
    r = await asyncio.to_thread(
        httpx.post,
        gated.url + CHAT,
        json={"model": "m", "messages": history, "max_tokens": 4},
        headers={"Authorization": f"Bearer {attempt['token']}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    _, nxt = calls_of(gated, attempt["id"])
    assert (nxt["parent_call_id"], nxt["prefix_reused"]) == (cut["id"], True)
    finish(gated, attempt["id"])
    with admin(gated) as c:
        lines = c.get("/api/v1/export/rollouts", params={"limit": 100_000}).text.splitlines()
    exported = [ExportedRollout.model_validate_json(line) for line in lines if attempt["id"] in line]
    samples, _ = build_samples(exported[-1])
    assert [s.call_ids for s in samples] == [[cut["id"], nxt["id"]]] and samples[0].reward == 1.0
    learnt = [t for t, m in zip(samples[0].input_ids, samples[0].loss_mask, strict=True) if m]
    assert learnt == cut["response_ids"] + nxt["response_ids"]


async def test_a_stream_cut_off_before_any_token_was_sent_is_dropped(gated: Server, gate: Gate) -> None:
    attempt = new_attempt(gated)
    before = dropped(gated, "client_gone")
    gate.close()
    gate.tokens.clear()
    try:
        await cut_stream(gated, "chat", attempt["token"], after=None)  # the role event only
        await eventually(lambda: dropped(gated, "client_gone") == before + 1, "the cut stream counted")
    finally:
        gate.tokens.set()
        gate.open.set()
    assert calls_of(gated, attempt["id"]) == []
