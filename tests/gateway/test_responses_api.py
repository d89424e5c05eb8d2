"""OpenAI Responses (`/v1/responses`, what Codex CLI calls) on a real gateway and engine, driven by the
official `openai` SDK: the same conversation asked in Responses and in Chat Completions is the
same prompt, token for token, and its continuation extends the earlier call exactly."""

import json
from typing import Any

import httpx
import openai
import pytest
from conftest import TOOL_ARGS
from gwhelpers import (
    calls_of,
    finish,
    gateway_fixture,  # noqa: F401 (the `gateway` fixture)
    harness_client,
    new_attempt,
    recorded_tokens,
    run_conversation,
)
from testsupport import Server

from inharness.demo import CALC_TOOL, FINAL, QUESTION, SYSTEM

TOOL = {"type": "function", **CALC_TOOL["function"]}
# What Codex CLI sends besides its items and function tools (built-in and namespaced tools, reasoning).
CODEX_EXTRAS: dict[str, Any] = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "medium", "summary": "auto"},
    "prompt_cache_key": "session-1",
    "parallel_tool_calls": False,
    "tool_choice": "auto",
    "extra_body": {"client_metadata": {"x": "y"}},
    "extra_headers": {"session-id": "session-1", "x-codex-turn-metadata": "{}"},
}
OTHER_TOOLS = [
    {"type": "web_search"},
    {"type": "namespace", "name": "mcp", "tools": []},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
]


def client_for(gw: Server, token: str, base: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=base or f"{gw.url}/v1", api_key=token, max_retries=0, timeout=60)


def ask(client: openai.OpenAI, input: Any, **extra: Any) -> Any:
    return client.responses.create(
        model="codex-model", instructions=SYSTEM, input=input, tools=[TOOL], temperature=0, **extra
    )


def items(response: Any) -> list[tuple[str, ...]]:
    """Output items without their ids: (message, text) or (function_call, name, arguments)."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append((item.type, item.name, item.arguments))
    return out


def follow_up(first: Any) -> list[Any]:
    """The second turn's input as Codex sends it: history items, the call's output."""
    (call,) = [i for i in first.output if i.type == "function_call"]
    history = [i.model_dump(exclude_none=True) for i in first.output]
    return [
        {"role": "user", "content": QUESTION},
        *history,
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]


def test_tool_turn_is_the_chat_prompt_and_continues_token_exactly(gateway: Server) -> None:
    attempt, chat_attempt = new_attempt(gateway), new_attempt(gateway)
    client = client_for(gateway, attempt["token"])
    first = ask(client, QUESTION)
    assert items(first) == [("function_call", "calculator", json.dumps(TOOL_ARGS))]
    assert first.status == "completed" and first.model == "codex-model"
    second = ask(client, follow_up(first))
    assert items(second) == [("message", FINAL)] and second.output_text == FINAL

    run_conversation(harness_client(gateway, chat_attempt["token"]))
    assert recorded_tokens(gateway, attempt["id"]) == recorded_tokens(gateway, chat_attempt["id"])
    r1, r2 = calls_of(gateway, attempt["id"])
    assert (r2["parent_call_id"], r2["prefix_reused"], r2["prefix_mismatch"]) == (r1["id"], True, None)
    assert {r["protocol"] for r in (r1, r2)} == {"openai.responses"}
    assert r1["request_id"] == first.id and r1["response"]["id"] == first.id
    assert first.usage.input_tokens == len(r1["prompt_ids"])
    assert first.usage.output_tokens == len(r1["response_ids"])


def _streamed(client: openai.OpenAI, input: Any, **extra: Any) -> tuple[Any, list[str]]:
    with client.responses.stream(
        model="codex-model", instructions=SYSTEM, input=input, tools=[TOOL], temperature=0, **extra
    ) as stream:
        kinds = [event.type for event in stream]
        return stream.get_final_response(), kinds


def test_streamed_answer_equals_the_plain_one(gateway: Server) -> None:
    plain_attempt, stream_attempt = new_attempt(gateway), new_attempt(gateway)
    plain = client_for(gateway, plain_attempt["token"])
    streaming = client_for(gateway, stream_attempt["token"])
    p1 = ask(plain, QUESTION)
    s1, kinds1 = _streamed(streaming, QUESTION)
    assert items(s1) == items(p1) and s1.usage == p1.usage and s1.status == "completed"
    assert kinds1 == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    p2 = ask(plain, follow_up(p1))
    s2, kinds2 = _streamed(streaming, follow_up(s1))
    assert items(s2) == items(p2) == [("message", FINAL)]
    assert kinds2[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds2[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" in kinds2
    assert recorded_tokens(gateway, stream_attempt["id"]) == recorded_tokens(gateway, plain_attempt["id"])
    streamed_calls = calls_of(gateway, stream_attempt["id"])
    assert streamed_calls[1]["prefix_reused"] and streamed_calls[0]["first_token_at"] is not None


def test_a_cut_answer_is_incomplete(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    r = ask(client_for(gateway, attempt["token"]), QUESTION, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_the_stored_response(gateway: Server) -> None:
    attempt, other = new_attempt(gateway), new_attempt(gateway)
    client = client_for(gateway, attempt["token"])
    first = ask(client, QUESTION)
    (call,) = first.output
    second = ask(
        client,
        [{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        previous_response_id=first.id,
    )
    assert second.output_text == FINAL and second.previous_response_id == first.id
    c1, c2 = calls_of(gateway, attempt["id"])
    assert (c2["parent_call_id"], c2["prefix_reused"], c2["prefix_mismatch"]) == (c1["id"], True, None)

    unstored = ask(client, QUESTION, store=False)
    elsewhere = ask(client_for(gateway, other["token"]), QUESTION)
    for previous, says in [
        ("resp_nope", "no response"),
        (elsewhere.id, "no response"),
        (unstored.id, "store"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, "go on", previous_response_id=previous)
        assert err.value.body["param"] == "previous_response_id" and says in err.value.message
    assert len(calls_of(gateway, attempt["id"])) == 3


def test_codex_extras_and_tools_it_cannot_run_are_accepted_with_a_note(gateway: Server) -> None:
    plain_attempt, codex_attempt = new_attempt(gateway), new_attempt(gateway)
    ask(client_for(gateway, plain_attempt["token"]), QUESTION)
    codex = client_for(gateway, codex_attempt["token"])
    r = codex.responses.create(
        model="codex-model",
        instructions=SYSTEM,
        input=[
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        tools=[TOOL, *OTHER_TOOLS],
        temperature=0,
        **CODEX_EXTRAS,
    )
    assert items(r)[0][:2] == ("function_call", "calculator") and r.store is False
    (plain,), (call,) = calls_of(gateway, plain_attempt["id"]), calls_of(gateway, codex_attempt["id"])
    assert call["prompt_ids"] == plain["prompt_ids"]
    assert len(call["notes"]) == 4 and plain["notes"] == []
    assert "tools[1] of type 'web_search'" in call["notes"][0] and "reasoning" in call["notes"][3]
    assert call["request"]["client_metadata"] == {"x": "y"}


def test_keys_unknown_401_finished_403_and_in_the_path(gateway: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        ask(client_for(gateway, "ih-not-a-key"), QUESTION)
    assert err.value.body["code"] == "invalid_api_key"
    attempt = new_attempt(gateway)
    r = ask(client_for(gateway, "ignored", f"{gateway.url}/t/{attempt['token']}/v1"), QUESTION)
    assert r.output and len(calls_of(gateway, attempt["id"])) == 1
    finish(gateway, attempt["id"])
    with pytest.raises(openai.PermissionDeniedError):
        ask(client_for(gateway, attempt["token"]), QUESTION)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for status in ("ok", "401", "403"):
        assert f'requests_total{{protocol="openai.responses",status="{status}"}}' in metrics


GOOD = {"model": "m", "input": QUESTION}
BAD_BODIES: list[tuple[str, Any, str]] = [
    ("malformed json", b'{"model": "m", "input": [', "not valid JSON"),
    ("no model", {"input": QUESTION}, "model"),
    ("wrong type", {**GOOD, "temperature": "hot"}, "temperature"),
    ("no input", {"model": "m"}, "input"),
    (
        "call without id",
        {**GOOD, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "call_id",
    ),
    (
        "image",
        {**GOOD, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        "input_image",
    ),
    ("bad tool schema", {**GOOD, "tools": [{**TOOL, "parameters": {"type": "array"}}]}, "parameters"),
    (
        "tool_choice names a missing tool",
        {**GOOD, "tool_choice": {"type": "function", "name": "nope"}},
        "nope",
    ),
    ("too long", {**GOOD, "input": "word " * 5000}, "context length"),
]


@pytest.mark.parametrize(("case", "body", "says"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
def test_bad_input_is_a_400_naming_the_field_and_records_nothing(
    gateway: Server, case: str, body: Any, says: str
) -> None:
    attempt = new_attempt(gateway)
    r = httpx.post(
        f"{gateway.url}/v1/responses",
        content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {attempt['token']}", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says.lower() in err["message"].lower(), err
    assert calls_of(gateway, attempt["id"]) == []
