"""Helpers of the gateway tests that drive a real gateway: one module-scoped gateway in front of the
session's engine, an attempt to call it with, and the calls it recorded."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import ADMIN
from testsupport import Server, gateway_server

from inharness.demo import CALC_TOOL, QUESTION, SYSTEM

FIRST_TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def serve(
    engine: Server, model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    """A gateway in front of `engine`, for a fixture to yield from."""
    db = tmp_path_factory.mktemp("gw") / "gateway.db"
    server = gateway_server(model, [engine.url], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module", name="gateway")
def gateway_fixture(
    engine: Server, tool_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    yield from serve(engine, tool_model, tmp_path_factory, log_dir)


def admin(gw: Server) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)


def new_attempt(
    gw: Server, *, lease: float = 600, max_attempts: int | None = None, pool: str = "default"
) -> dict[str, Any]:
    with admin(gw) as c:
        body: dict[str, Any] = {"tasks": [{"question": QUESTION}], "pool": pool}
        if max_attempts:
            body["max_attempts"] = max_attempts
        assert c.post("/api/v1/rollouts", json=body).status_code == 201
        r = c.post("/api/v1/attempts/claim", json={"pool": pool, "lease_seconds": lease})
        assert r.status_code == 200, r.text
        return r.json()["attempt"]


def finish(gw: Server, attempt_id: str) -> None:
    with admin(gw) as c:
        r = c.post(f"/api/v1/attempts/{attempt_id}/complete", json={"status": "succeeded", "reward": 1.0})
        assert r.status_code == 200, r.text


def calls_of(gw: Server, attempt_id: str) -> list[dict[str, Any]]:
    with admin(gw) as c:
        r = c.get(f"/api/v1/attempts/{attempt_id}/calls")
        assert r.status_code == 200, r.text
        return r.json()["calls"]


def harness_client(gw: Server, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=token, max_retries=0, timeout=60)


def run_conversation(client: openai.OpenAI, model: str = "gpt-4o-whatever") -> list[Any]:
    """The harness loop in Chat Completions: ask, run the tool it asked for, ask again."""
    messages: list[Any] = list(FIRST_TURN)
    first = client.chat.completions.create(model=model, messages=messages, tools=[CALC_TOOL], temperature=0)
    msg = first.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    second = client.chat.completions.create(model=model, messages=messages, tools=[CALC_TOOL], temperature=0)
    return [first, second]


def recorded_tokens(gw: Server, attempt_id: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of each recorded call of the attempt, in order."""
    return [(c["prompt_ids"], c["response_ids"]) for c in calls_of(gw, attempt_id)]
