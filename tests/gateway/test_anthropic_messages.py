"""Anthropic Messages (`/v1/messages`, what Claude Code calls) on a real gateway and engine, driven by
the official `anthropic` SDK: the same conversation asked in Messages and in Chat Completions is
the same prompt, token for token; errors come in Anthropic's format with its status codes."""

import json
from typing import Any

import anthropic
import httpx
import pytest
from conftest import TOOL_ARGS
from gwhelpers import (
    admin,
    calls_of,
    finish,
    gateway_fixture,  # noqa: F401 (the `gateway` fixture)
    harness_client,
    new_attempt,
    recorded_tokens,
    run_conversation,
)
from testsupport import Server, free_port

from inharness.demo import CALC_TOOL, FINAL, QUESTION, SYSTEM

FN = CALC_TOOL["function"]
TOOL = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}
USER = [{"role": "user", "content": QUESTION}]
CLAUDE_CODE_MAX_TOKENS = 128_000
# The SDK no longer takes sampling settings (nor does Claude Code send them); the gateway still reads
# `temperature` and `top_p`, and greedy answers make the comparisons below exact.
GREEDY = {"temperature": 0}


def client_for(gw: Server, key: str, base: str = "", **auth: Any) -> anthropic.Anthropic:
    credentials = auth or {"api_key": key}
    return anthropic.Anthropic(base_url=base or gw.url, max_retries=0, timeout=60, **credentials)


def ask(client: anthropic.Anthropic, messages: list[Any], **extra: Any) -> Any:
    args = {"max_tokens": CLAUDE_CODE_MAX_TOKENS, "extra_body": GREEDY, **extra}
    return client.messages.create(model="claude-x", system=SYSTEM, messages=messages, tools=[TOOL], **args)


def blocks(message: Any) -> list[tuple[Any, ...]]:
    """Content blocks without their ids: (text, text) or (tool_use, name, input)."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]


def follow_up(first: Any) -> list[Any]:
    """The second turn as Claude Code sends it: the reply echoed, the tool's result."""
    (use,) = [b for b in first.content if b.type == "tool_use"]
    return [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
    ]


def test_tool_turn_is_the_chat_prompt_and_continues_token_exactly(gateway: Server) -> None:
    attempt, chat_attempt = new_attempt(gateway), new_attempt(gateway)
    client = client_for(gateway, attempt["token"])
    first = ask(client, USER)
    assert blocks(first) == [("tool_use", "calculator", TOOL_ARGS)]
    assert (first.stop_reason, first.model, first.role) == ("tool_use", "claude-x", "assistant")
    second = ask(client, follow_up(first))
    assert blocks(second) == [("text", FINAL)] and second.stop_reason == "end_turn"

    run_conversation(harness_client(gateway, chat_attempt["token"]))
    assert recorded_tokens(gateway, attempt["id"]) == recorded_tokens(gateway, chat_attempt["id"])
    a1, a2 = calls_of(gateway, attempt["id"])
    assert (a2["parent_call_id"], a2["prefix_reused"], a2["prefix_mismatch"]) == (a1["id"], True, None)
    assert {a["protocol"] for a in (a1, a2)} == {"anthropic.messages"}
    assert a1["request_id"] == first.id and a1["request"]["max_tokens"] == CLAUDE_CODE_MAX_TOKENS
    assert (first.usage.input_tokens, first.usage.output_tokens) == (
        len(a1["prompt_ids"]),
        len(a1["response_ids"]),
    )
    counted = client.messages.count_tokens(model="claude-x", system=SYSTEM, messages=USER, tools=[TOOL])
    assert counted.input_tokens == len(a1["prompt_ids"])
    assert len(calls_of(gateway, attempt["id"])) == 2


def _streamed(client: anthropic.Anthropic, messages: list[Any], **extra: Any) -> tuple[Any, list[str]]:
    args = {"max_tokens": CLAUDE_CODE_MAX_TOKENS, "extra_body": GREEDY, **extra}
    with client.messages.stream(
        model="claude-x", system=SYSTEM, messages=messages, tools=[TOOL], **args
    ) as s:
        kinds = [e.type for e in s if e.type not in ("text", "input_json")]  # the SDK's own helpers
        return s.get_final_message(), kinds


def test_streamed_answer_equals_the_plain_one(gateway: Server) -> None:
    plain_attempt, stream_attempt = new_attempt(gateway), new_attempt(gateway)
    plain = client_for(gateway, plain_attempt["token"])
    streaming = client_for(gateway, stream_attempt["token"])
    p1 = ask(plain, USER)
    s1, kinds1 = _streamed(streaming, USER)
    assert blocks(s1) == blocks(p1) and (s1.stop_reason, s1.usage) == (p1.stop_reason, p1.usage)
    assert kinds1 == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    p2 = ask(plain, follow_up(p1))
    s2, kinds2 = _streamed(streaming, follow_up(s1))
    assert blocks(s2) == blocks(p2) == [("text", FINAL)] and s2.stop_reason == "end_turn"
    assert kinds2[:2] == ["message_start", "content_block_start"] and kinds2[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert recorded_tokens(gateway, stream_attempt["id"]) == recorded_tokens(gateway, plain_attempt["id"])
    streamed_calls = calls_of(gateway, stream_attempt["id"])
    assert streamed_calls[1]["prefix_reused"]

    cut = ask(plain, follow_up(p1), stop_sequences=[" is"])
    assert (cut.stop_reason, cut.stop_sequence, blocks(cut)) == (
        "stop_sequence",
        " is",
        [("text", "The answer")],
    )
    cut_streamed, _ = _streamed(streaming, follow_up(s1), stop_sequences=[" is"])
    assert (cut_streamed.stop_reason, blocks(cut_streamed)) == ("stop_sequence", blocks(cut))
    assert ask(plain, USER, max_tokens=2).stop_reason == "max_tokens"


def test_claude_code_extras_are_accepted_and_what_the_model_cannot_take_is_noted(gateway: Server) -> None:
    plain_attempt, cc_attempt = new_attempt(gateway), new_attempt(gateway)
    first = ask(client_for(gateway, plain_attempt["token"]), USER)
    ask(client_for(gateway, plain_attempt["token"]), follow_up(first))
    history = follow_up(first)
    history[1]["content"].insert(0, {"type": "thinking", "thinking": "use the tool", "signature": "sig"})
    cc = client_for(gateway, "", auth_token=cc_attempt["token"])  # Authorization: Bearer
    cc.beta.messages.create(  # ?beta=true with anthropic-beta, as Claude Code calls it
        model="claude-x",
        max_tokens=CLAUDE_CODE_MAX_TOKENS,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=history,
        tools=[TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u"},
        betas=["interleaved-thinking-2025-05-14"],
        output_config={"effort": "high"},
        extra_body={**GREEDY, "context_management": {"edits": []}},
    )
    (_, plain), (call,) = calls_of(gateway, plain_attempt["id"]), calls_of(gateway, cc_attempt["id"])
    assert call["prompt_ids"] == plain["prompt_ids"]
    assert call["notes"] == [
        "tools[1] of type 'web_search_20250305' is left out of the prompt: the model cannot run it",
        "messages[1].content[0]: thinking is left out of the prompt",
    ]
    assert call["request"]["output_config"] == {"effort": "high"}


def _error(exc: anthropic.APIStatusError, kind: str) -> str:
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    return exc.body["error"]["message"]


def test_keys_unknown_401_finished_403_and_in_the_path(gateway: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as err:
        ask(client_for(gateway, "ih-not-a-key"), USER)
    assert "unknown API key" in _error(err.value, "authentication_error")
    attempt = new_attempt(gateway)
    assert ask(client_for(gateway, "ignored", f"{gateway.url}/t/{attempt['token']}"), USER).content
    finish(gateway, attempt["id"])
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        ask(client_for(gateway, attempt["token"]), USER)
    assert "succeeded" in _error(denied.value, "permission_error")
    with pytest.raises(anthropic.PermissionDeniedError):
        client_for(gateway, attempt["token"]).messages.count_tokens(model="m", messages=USER)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for status in ("ok", "401", "403"):
        assert f'requests_total{{protocol="anthropic.messages",status="{status}"}}' in metrics


GOOD = {"model": "m", "max_tokens": 16, "messages": USER}
TOOL_USE = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {}}],
}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
BAD_BODIES: list[tuple[str, Any, str]] = [
    ("malformed json", b'{"model": "m", "messages": [', "not valid JSON"),
    ("no max_tokens", {"model": "m", "messages": USER}, "max_tokens"),
    ("temperature above 1", {**GOOD, "temperature": 1.5}, "temperature"),
    ("no messages", {**GOOD, "messages": []}, "messages"),
    ("bad role", {**GOOD, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ("image", {**GOOD, "messages": [{"role": "user", "content": [IMAGE]}]}, "image"),
    (
        "image in a tool result",
        {
            **GOOD,
            "messages": [
                *USER,
                TOOL_USE,
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}],
                },
            ],
        },
        "image",
    ),
    (
        "tool_use without id",
        {**GOOD, "messages": [*USER, {**TOOL_USE, "content": [{"type": "tool_use"}]}]},
        "id",
    ),
    ("bad input_schema", {**GOOD, "tools": [{**TOOL, "input_schema": {"type": "array"}}]}, "input_schema"),
    ("tool_choice names a missing tool", {**GOOD, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ("prefill", {**GOOD, "messages": [*USER, {"role": "assistant", "content": "The"}]}, "prefill"),
    ("too long", {**GOOD, "messages": [{"role": "user", "content": "word " * 5000}]}, "context length"),
]


@pytest.mark.parametrize(("case", "body", "says"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
def test_bad_input_is_a_400_in_anthropic_format_and_records_nothing(
    gateway: Server, case: str, body: Any, says: str
) -> None:
    attempt = new_attempt(gateway)
    r = httpx.post(
        f"{gateway.url}/v1/messages",
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={
            "x-api-key": attempt["token"],
            "content-type": "application/json",
            "anthropic-version": "2023-06-01",
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert says.lower() in r.json()["error"]["message"].lower(), r.json()
    assert calls_of(gateway, attempt["id"]) == []


def test_no_engine_is_529_overloaded(gateway: Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    attempt = new_attempt(gateway)
    with admin(gateway) as c:
        assert c.post(
            "/api/v1/models/versions", json={"version": 99, "engines": [dead], "activate": True}
        ).is_success
        try:
            with pytest.raises(anthropic.OverloadedError) as err:
                ask(client_for(gateway, attempt["token"]), USER)
            assert err.value.status_code == 529 and "engine" in _error(err.value, "overloaded_error")
            with pytest.raises(anthropic.OverloadedError):
                _streamed(client_for(gateway, attempt["token"]), USER)
        finally:
            assert c.post("/api/v1/models/active", json={"version": 0}).is_success
    assert calls_of(gateway, attempt["id"]) == []
