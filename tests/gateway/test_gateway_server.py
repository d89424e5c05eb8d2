"""The gateway as a real server on 127.0.0.1, in front of a real engine, driven by the official
`openai` client the way an unmodified harness drives it."""

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import ADMIN, TOOL_ARGS
from gwhelpers import (
    FIRST_TURN,
    admin,
    calls_of,
    gateway_fixture,  # noqa: F401 (the `gateway` fixture)
    harness_client,
    new_attempt,
    run_conversation,
)
from testsupport import Server, free_port, gateway_server

from inharness.demo import CALC_TOOL, FINAL


def test_multi_turn_tool_conversation_is_recorded_prefix_exact(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    first, second = run_conversation(harness_client(gateway, attempt["token"]))

    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == TOOL_ARGS
    assert second.choices[0].message.content == FINAL
    assert first.model == "gpt-4o-whatever"  # the requested name is echoed; the active policy served it

    c1, c2 = calls_of(gateway, attempt["id"])
    assert (
        c2["prompt_ids"][: len(c1["prompt_ids"]) + len(c1["response_ids"])]
        == c1["prompt_ids"] + c1["response_ids"]
    )
    assert (c2["parent_call_id"], c2["prefix_reused"], c2["prefix_mismatch"]) == (c1["id"], True, None)
    assert (c1["parent_call_id"], c1["prefix_reused"], c1["prefix_mismatch"]) == (None, False, None)
    for c in (c1, c2):
        assert len(c["response_logprobs"]) == len(c["response_ids"]) > 0
        assert all(lp <= 0 for lp in c["response_logprobs"])
        assert c["model_version"] == 0 and c["requested_model"] == "gpt-4o-whatever"
        assert c["started_at"] <= c["finished_at"]
    assert c1["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert first.usage.prompt_tokens == len(c1["prompt_ids"])
    assert first.usage.completion_tokens == len(c1["response_ids"])


def _streamed(
    client: openai.OpenAI, messages: list[Any], **extra: Any
) -> tuple[str | None, list[tuple[str, str]], str, Any]:
    content, calls, finish, usage = "", {}, "", None
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=[CALC_TOOL],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish, usage


def test_streaming_matches_non_streaming(gateway: Server) -> None:
    plain_attempt, stream_attempt = new_attempt(gateway), new_attempt(gateway)
    first, second = run_conversation(harness_client(gateway, plain_attempt["token"]))

    client = harness_client(gateway, stream_attempt["token"])
    messages: list[Any] = list(FIRST_TURN)
    content, calls, finish, usage = _streamed(client, messages)
    m1 = first.choices[0].message
    assert (content, finish) == (m1.content, "tool_calls")
    assert calls == [(c.function.name, c.function.arguments) for c in m1.tool_calls]
    assert usage.completion_tokens == first.usage.completion_tokens

    messages.append(
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": "call_s", "type": "function", "function": {"name": n, "arguments": a}}
                for n, a in calls
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "call_s", "content": "5"})
    content2, calls2, finish2, _ = _streamed(client, messages)
    assert (content2, calls2, finish2) == (second.choices[0].message.content, [], "stop")

    plain, streamed = calls_of(gateway, plain_attempt["id"]), calls_of(gateway, stream_attempt["id"])
    assert [c["prompt_ids"] for c in streamed] == [c["prompt_ids"] for c in plain]
    assert [c["response_ids"] for c in streamed] == [c["response_ids"] for c in plain]
    assert streamed[1]["prefix_reused"] and streamed[0]["first_token_at"] is not None


def test_key_in_path_prefix_is_accepted(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    client = openai.OpenAI(
        base_url=f"{gateway.url}/t/{attempt['token']}/v1", api_key="ignored", max_retries=0
    )
    r = client.chat.completions.create(model="m", messages=FIRST_TURN, tools=[CALC_TOOL], temperature=0)
    assert r.choices[0].message.tool_calls
    assert len(calls_of(gateway, attempt["id"])) == 1


def test_unknown_key_is_401_and_finished_attempt_is_403(gateway: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        harness_client(gateway, "ih-not-a-key").chat.completions.create(model="m", messages=FIRST_TURN)
    assert err.value.body["code"] == "invalid_api_key"

    attempt = new_attempt(gateway)
    with admin(gateway) as c:
        r = c.post(f"/api/v1/attempts/{attempt['id']}/complete", json={"status": "succeeded", "reward": 1.0})
        assert r.status_code == 200
    with pytest.raises(openai.PermissionDeniedError) as err:
        harness_client(gateway, attempt["token"]).chat.completions.create(model="m", messages=FIRST_TURN)
    assert "succeeded" in err.value.message


def _raw(gw: Server, token: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {token}", "content-type": "application/json"},
        timeout=60,
    )


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("malformed json", b'{"model": "m", "messages": [', "not valid JSON"),
    ("wrong type", {"model": "m", "messages": FIRST_TURN, "temperature": "hot"}, "temperature"),
    ("out of range", {"model": "m", "messages": FIRST_TURN, "n": 0}, "n"),
    ("no messages", {"model": "m"}, "messages"),
    ("empty messages", {"model": "m", "messages": []}, "messages"),
    ("bad role", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    (
        "tool without id",
        {"model": "m", "messages": [*FIRST_TURN, {"role": "tool", "content": "5"}]},
        "tool_call_id",
    ),
    (
        "invalid tool schema",
        {
            "model": "m",
            "messages": FIRST_TURN,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
                }
            ],
        },
        "JSON Schema",
    ),
    (
        "bad function name",
        {
            "model": "m",
            "messages": FIRST_TURN,
            "tools": [{"type": "function", "function": {"name": "has space"}}],
        },
        "function name",
    ),
    (
        "tool_choice names a missing tool",
        {
            "model": "m",
            "messages": FIRST_TURN,
            "tools": [CALC_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "nope",
    ),
    ("too long", {"model": "m", "messages": [{"role": "user", "content": "word " * 5000}]}, "context length"),
]


@pytest.mark.parametrize(("case", "body", "says"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
def test_bad_input_is_a_4xx_in_openai_format_and_touches_nothing(
    gateway: Server, case: str, body: Any, says: str
) -> None:
    attempt = new_attempt(gateway)
    ok = harness_client(gateway, attempt["token"]).chat.completions.create(
        model="m", messages=FIRST_TURN, max_tokens=4
    )
    assert ok.choices
    before = calls_of(gateway, attempt["id"])

    r = _raw(gateway, attempt["token"], body if isinstance(body, bytes) else json.dumps(body).encode())
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert says.lower() in err["message"].lower(), err
    assert set(err) == {"message", "type", "param", "code"}
    assert calls_of(gateway, attempt["id"]) == before


def test_lease_expiry_requeues_and_stale_completion_is_refused(gateway: Server) -> None:
    stale = new_attempt(gateway, lease=0.5, max_attempts=3, pool="lease-test")
    with admin(gateway) as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ro = c.get(f"/api/v1/rollouts/{stale['rollout_id']}").json()
            if ro["status"] == "queued":
                break
            time.sleep(0.1)
        assert ro["status"] == "queued" and ro["attempts"][0]["failure_reason"] == "lease expired"

        fresh = c.post("/api/v1/attempts/claim", json={"pool": "lease-test"}).json()["attempt"]
        assert fresh["rollout_id"] == stale["rollout_id"] and fresh["seq"] == 2

        before = c.get(f"/api/v1/rollouts/{stale['rollout_id']}").json()
        r = c.post(f"/api/v1/attempts/{stale['id']}/complete", json={"status": "succeeded", "reward": 1.0})
        assert r.status_code == 409 and "expired" in r.json()["error"]["message"]
        assert c.get(f"/api/v1/rollouts/{stale['rollout_id']}").json() == before
        r = c.post(f"/api/v1/attempts/{stale['id']}/heartbeat", json={})
        assert r.status_code == 409

        assert (
            c.post(f"/api/v1/attempts/{fresh['id']}/heartbeat", json={"lease_seconds": 60}).status_code == 200
        )
        r = c.post(f"/api/v1/attempts/{fresh['id']}/complete", json={"status": "succeeded", "reward": 0.25})
        assert r.status_code == 200
        ro = c.get(f"/api/v1/rollouts/{stale['rollout_id']}").json()
        assert (ro["status"], ro["reward"]) == ("succeeded", 0.25)
        assert c.post("/api/v1/attempts/claim", json={"pool": "lease-test"}).status_code == 204


def test_pause_holds_calls_then_releases_them(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    client = harness_client(gateway, attempt["token"])
    with admin(gateway) as c:
        state = c.post("/api/v1/serving/pause", json={"hold_seconds": 60}).json()
        assert state["paused"] is True
        result: dict[str, Any] = {}

        def harness() -> None:
            try:
                result["r"] = client.chat.completions.create(model="m", messages=FIRST_TURN, max_tokens=4)
            except Exception as exc:  # the assertion below reports it
                result["error"] = exc

        t = threading.Thread(target=harness)
        t.start()
        try:
            deadline = time.monotonic() + 30
            while c.get("/api/v1/serving").json()["held"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get("/api/v1/serving").json()["held"] == 1
            assert not result
        finally:
            assert c.post("/api/v1/serving/resume").json()["paused"] is False
            t.join(60)
    assert "error" not in result and result["r"].choices
    assert len(calls_of(gateway, attempt["id"])) == 1


def test_export_streams_finished_rollouts_with_their_calls(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    run_conversation(harness_client(gateway, attempt["token"]))
    with admin(gateway) as c:
        c.post(f"/api/v1/attempts/{attempt['id']}/complete", json={"status": "succeeded", "reward": 1.0})
        lines = [
            json.loads(line)
            for line in c.get("/api/v1/export/rollouts", params={"limit": 100000}).text.splitlines()
        ]
    mine = [x for x in lines if x["rollout"]["id"] == attempt["rollout_id"]]
    assert len(mine) == 1 and len(mine[0]["calls"]) == 2 and mine[0]["rollout"]["reward"] == 1.0
    cursors = [x["cursor"] for x in lines]
    assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)
    with admin(gateway) as c:
        after = c.get("/api/v1/export/rollouts", params={"after": cursors[-2]}).text.splitlines()
    assert [json.loads(x)["cursor"] for x in after] == [cursors[-1]]


def test_metrics_openapi_and_models(gateway: Server) -> None:
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in (
        "inharness_gateway_requests_total",
        "inharness_gateway_request_seconds_bucket",
        "inharness_gateway_in_flight",
        "inharness_gateway_queue_depth",
        "inharness_gateway_tokens_total",
        "inharness_gateway_prefix_reused_total",
    ):
        assert name in text, name
    paths = httpx.get(f"{gateway.url}/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/api/v1/attempts/claim", "/api/v1/serving/pause"} <= set(paths)
    assert httpx.get(f"{gateway.url}/v1/models").json()["data"][0]["object"] == "model"
    assert httpx.get(f"{gateway.url}/api/v1/serving").status_code == 401


def test_kill_9_and_restart_keeps_every_answered_call(
    engine: Server, tool_model: Path, tmp_path: Path, log_dir: Path
) -> None:
    db = tmp_path / "gw.db"
    gw = gateway_server(tool_model, [engine.url], db, log_dir, admin_token=ADMIN).start()
    try:
        attempt = new_attempt(gw)
        done = new_attempt(gw)
        client = harness_client(gw, attempt["token"])
        answered = [
            client.chat.completions.create(model="m", messages=FIRST_TURN, max_tokens=3, seed=i)
            for i in range(5)
        ]
        with admin(gw) as c:
            c.post(f"/api/v1/attempts/{done['id']}/complete", json={"status": "succeeded", "reward": 1.0})
        before = calls_of(gw, attempt["id"])
        gw.kill9()
        gw.start()
        after = calls_of(gw, attempt["id"])
        assert len(answered) == len(before) == len(after) == 5
        assert after == before
        with admin(gw) as c:
            ro = c.get(f"/api/v1/rollouts/{done['rollout_id']}").json()
        assert (ro["status"], ro["reward"]) == ("succeeded", 1.0)
        # the restarted gateway still continues the attempt's conversation token-exactly
        client.chat.completions.create(model="m", messages=FIRST_TURN, max_tokens=3, seed=0)
        assert calls_of(gw, attempt["id"])[-1]["prompt_ids"] == before[0]["prompt_ids"]
    finally:
        gw.stop()


def test_dead_engine_is_skipped_and_no_engine_gives_a_clear_503(
    engine: Server, tool_model: Path, tmp_path: Path, log_dir: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = gateway_server(tool_model, [dead, engine.url], tmp_path / "a.db", log_dir, admin_token=ADMIN).start()
    try:
        for _ in range(3):
            attempt = new_attempt(gw)
            r = harness_client(gw, attempt["token"]).chat.completions.create(
                model="m", messages=FIRST_TURN, max_tokens=2
            )
            assert r.choices
            assert calls_of(gw, attempt["id"])[0]["engine"] == engine.url
    finally:
        gw.stop()
    gw = gateway_server(tool_model, [dead], tmp_path / "b.db", log_dir, admin_token=ADMIN).start()
    try:
        attempt = new_attempt(gw)
        with pytest.raises(openai.InternalServerError) as err:
            harness_client(gw, attempt["token"]).chat.completions.create(model="m", messages=FIRST_TURN)
        assert err.value.status_code == 503 and err.value.body["code"] == "engine_unavailable"
        assert calls_of(gw, attempt["id"]) == []
    finally:
        gw.stop()


async def test_control_client_drives_the_queue_end_to_end(gateway: Server) -> None:
    from inharness.gateway.client import GatewayClient, GatewayError

    async with GatewayClient(gateway.url, ADMIN) as gw:
        created = await gw.create_rollouts([{"q": 1}], group_size=2, pool="client-test", labels={"step": "0"})
        assert len(created) == 2 and created[0].group_id == created[1].group_id
        attempt = await gw.claim("client-test", lease_seconds=60)
        assert attempt is not None and attempt.task == {"q": 1}
        assert (await gw.heartbeat(attempt.id, 120)).lease_expires_at > attempt.lease_expires_at
        harness_client(gateway, attempt.token).chat.completions.create(
            model="m", messages=FIRST_TURN, max_tokens=2
        )
        assert len(await gw.calls(attempt.id)) == 1
        _, duplicate = await gw.complete(attempt.id, "succeeded", 1.0)
        assert not duplicate and (await gw.complete(attempt.id, "succeeded", 1.0))[1]
        with pytest.raises(GatewayError) as err:
            await gw.complete(attempt.id, "failed")
        assert err.value.status == 409
        exported = [e async for e in gw.export(bodies=False)]
        assert attempt.rollout_id in {e.rollout.id for e in exported}
        assert (await gw.versions()).active == 0
        assert (await gw.pause(hold_seconds=30)).paused and not (await gw.resume()).paused
        assert await gw.claim("client-test") is not None and await gw.claim("client-test") is None


def test_stop_strings_cut_the_answer_and_the_record_keeps_the_engine_ids(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    client = harness_client(gateway, attempt["token"])
    first, _ = run_conversation(client)
    messages: list[Any] = [*FIRST_TURN, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append(
        {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "5"}
    )
    cut = client.chat.completions.create(
        model="m", messages=messages, tools=[CALC_TOOL], temperature=0, stop=[" is"]
    )
    assert cut.choices[0].message.content == FINAL[: FINAL.find(" is")]
    assert cut.choices[0].finish_reason == "stop"
    streamed, _, finish, _ = _streamed(client, messages, stop=[" is"])
    assert (streamed, finish) == (cut.choices[0].message.content, "stop")
    full, cut_call, streamed_call = calls_of(gateway, attempt["id"])[1:]
    assert cut_call["response_ids"] == streamed_call["response_ids"]
    assert cut_call["response_ids"] == full["response_ids"][: len(cut_call["response_ids"])]
    assert len(cut_call["response_ids"]) < len(full["response_ids"])
