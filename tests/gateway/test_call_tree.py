"""Calls that branch, on a real gateway and engine driven by the official SDKs: a call extends the
earlier call its messages continue (not only the latest), and a call that extends none is recorded
and counted with the reason it starts a new root (docs/gateway.md#calls-that-branch)."""

from typing import Any

import anthropic
import httpx
import openai
from gwhelpers import (
    FIRST_TURN,
    calls_of,
    gateway_fixture,  # noqa: F401 (the `gateway` fixture)
    harness_client,
    new_attempt,
)
from testsupport import Server

from inharness.demo import CALC_TOOL, QUESTION
from inharness.gateway.prompts import HISTORY_REWRITTEN, NEW_CONVERSATION, SYSTEM_CHANGED

FN = CALC_TOOL["function"]
SIDE_CALL = [{"role": "system", "content": "Title this conversation."}, {"role": "user", "content": QUESTION}]


def ask(client: openai.OpenAI, messages: list[Any], **extra: Any) -> Any:
    args: dict[str, Any] = {"tools": [CALC_TOOL], "temperature": 0, **extra}
    return client.chat.completions.create(model="m", messages=messages, **args)


def after_tool(first: Any, result: str, head: list[Any] = FIRST_TURN) -> list[Any]:
    """`head`, the reply echoed as a harness echoes it, the tool's result."""
    msg = first.choices[0].message
    tool = [{"role": "tool", "tool_call_id": c.id, "content": result} for c in msg.tool_calls or []]
    return [*head, msg.model_dump(exclude_none=True), *tool]


def extends(call: dict[str, Any], parent: dict[str, Any]) -> bool:
    n = len(parent["prompt_ids"]) + len(parent["response_ids"])
    return call["prompt_ids"][:n] == parent["prompt_ids"] + parent["response_ids"]


def test_a_call_extends_an_earlier_call_that_is_not_the_latest(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    client = harness_client(gateway, attempt["token"])
    first = ask(client, FIRST_TURN)
    ask(client, after_tool(first, "5"))  # the main line goes on
    ask(client, SIDE_CALL)
    ask(client, after_tool(first, "6"))  # a branch from the first call, two calls later
    c1, c2, side, branch = calls_of(gateway, attempt["id"])
    assert (c2["parent_call_id"], branch["parent_call_id"]) == (c1["id"], c1["id"])
    assert (branch["prefix_reused"], branch["prefix_mismatch"]) == (True, None)
    assert extends(branch, c1) and extends(c2, c1) and not extends(branch, c2)
    assert (side["parent_call_id"], side["prefix_mismatch"]) == (None, NEW_CONVERSATION)


def test_a_sub_agent_branches_and_continues_its_own_line(gateway: Server) -> None:
    """Claude Code's `Agent` tool through Anthropic Messages: the sub-agent's first call is a new
    conversation, its second extends its first, and the main line then extends the main call."""
    attempt = new_attempt(gateway)
    client = anthropic.Anthropic(base_url=gateway.url, api_key=attempt["token"], max_retries=0, timeout=60)
    tool = {"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}

    def ask_messages(system: str, messages: list[Any]) -> Any:
        return client.messages.create(
            model="claude-x",
            system=system,
            messages=messages,
            tools=[tool],
            max_tokens=16,
            extra_body={"temperature": 0},
        )

    def follow(first: Any, head: list[Any]) -> list[Any]:
        uses = [b for b in first.content if b.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": "5"} for u in uses]
        echoed = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
        return [*head, echoed, {"role": "user", "content": results or "go on"}]

    main_head = [{"role": "user", "content": QUESTION}]
    sub_head = [{"role": "user", "content": "Sub-task: " + QUESTION}]
    main = ask_messages("You are the main agent.", main_head)
    sub = ask_messages("You are a sub-agent.", sub_head)
    ask_messages("You are a sub-agent.", follow(sub, sub_head))
    ask_messages("You are the main agent.", follow(main, main_head))
    m1, s1, s2, m2 = calls_of(gateway, attempt["id"])
    assert (s1["parent_call_id"], s1["prefix_mismatch"]) == (None, NEW_CONVERSATION)
    assert (s2["parent_call_id"], s2["prefix_reused"], s2["prefix_mismatch"]) == (s1["id"], True, None)
    assert (m2["parent_call_id"], m2["prefix_reused"], m2["prefix_mismatch"]) == (m1["id"], True, None)
    assert extends(s2, s1) and extends(m2, m1)


def test_each_reason_for_a_new_root_is_recorded_and_counted(gateway: Server) -> None:
    attempt = new_attempt(gateway)
    client = harness_client(gateway, attempt["token"])
    first = ask(client, FIRST_TURN)
    ask(client, SIDE_CALL)  # no assistant turn: a side call, a sub-agent's first call
    other_system = [{"role": "system", "content": "Summarise the conversation."}, FIRST_TURN[1]]
    ask(client, after_tool(first, "5", head=other_system))  # the same turns under another system prompt
    edited = {"role": "assistant", "content": "I edited this reply."}
    ask(client, [*FIRST_TURN, edited, {"role": "user", "content": "go on"}])  # history rewritten
    c1, *roots = calls_of(gateway, attempt["id"])
    assert c1["prefix_mismatch"] is None  # an attempt's first call is a root without a reason
    assert [(c["parent_call_id"], c["prefix_reused"], c["prefix_mismatch"]) for c in roots] == [
        (None, False, NEW_CONVERSATION),
        (None, False, SYSTEM_CHANGED),
        (None, False, HISTORY_REWRITTEN),
    ]
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for reason in (NEW_CONVERSATION, SYSTEM_CHANGED, HISTORY_REWRITTEN):
        assert f'inharness_gateway_prefix_mismatch_total{{reason="{reason}"}}' in metrics, reason
