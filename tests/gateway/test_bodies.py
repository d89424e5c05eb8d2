"""`inharness gateway --bodies none` on a real gateway and engine: calls keep everything training reads
(token ids, log-probs, the call tree) and no bodies; the export and the calls list give none, and a
Responses call that names a `previous_response_id` is refused in the Responses error format, since its
conversation cannot be rebuilt."""

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import ADMIN
from gwhelpers import admin, calls_of, finish, harness_client, new_attempt, run_conversation
from testsupport import Server, gateway_server

from inharness.demo import CALC_TOOL, QUESTION, SYSTEM


@pytest.fixture(scope="module", name="gateway")
def bodiless_gateway(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("gw") / "gateway.db"
    server = gateway_server(
        tool_model, [engine.url], db, log_dir, admin_token=ADMIN, extra=["--bodies", "none"]
    ).start()
    yield server
    server.stop()


def test_calls_keep_ids_logprobs_and_their_tree_but_no_bodies_in_the_list_or_the_export(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway)
    first, second = run_conversation(harness_client(gateway, attempt["token"]))
    assert first.choices[0].message.tool_calls and second.choices[0].message.content
    c1, c2 = calls_of(gateway, attempt["id"])
    assert (c1["request"], c1["response"], c2["request"], c2["response"]) == (None, None, None, None)
    for call in (c1, c2):
        assert call["prompt_ids"] and len(call["response_logprobs"]) == len(call["response_ids"]) > 0
    assert (c2["parent_call_id"], c2["prefix_reused"]) == (c1["id"], True)
    assert c2["prompt_ids"][: len(c1["prompt_ids"]) + len(c1["response_ids"])] == (
        c1["prompt_ids"] + c1["response_ids"]
    )
    finish(gateway, attempt["id"])
    with admin(gateway) as c:
        lines = c.get("/api/v1/export/rollouts", params={"limit": 1000, "bodies": True}).text.splitlines()
    (mine,) = [e for e in map(json.loads, lines) if e["rollout"]["id"] == attempt["rollout_id"]]
    assert [(c["request"], c["response"], c["prompt_ids"]) for c in mine["calls"]] == [
        (None, None, c1["prompt_ids"]),
        (None, None, c2["prompt_ids"]),
    ]


def test_a_previous_response_id_is_refused_in_the_responses_format_saying_no_bodies_are_kept(
    gateway: Server,
) -> None:
    attempt = new_attempt(gateway)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=attempt["token"], max_retries=0, timeout=60)
    tool = {"type": "function", **CALC_TOOL["function"]}
    ask = {"model": "codex-model", "instructions": SYSTEM, "tools": [tool], "temperature": 0}
    first = client.responses.create(input=QUESTION, **ask)
    (call,) = first.output
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
            previous_response_id=first.id,
            **ask,
        )
    error = refused.value.body
    assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_not_found")
    assert "keeps no bodies (--bodies none)" in error["message"] and first.id in error["message"]
    # The whole conversation as input still works, and is recorded as the first call's continuation.
    items = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output]]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    client.responses.create(input=items, **ask)
    c1, c2 = calls_of(gateway, attempt["id"])
    assert c2["parent_call_id"] == c1["id"] and c2["request"] is None
