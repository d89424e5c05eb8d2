"""Property-based fuzzing of the gateway's own OpenAPI document with Schemathesis, against real
gateways on 127.0.0.1: valid and invalid requests generated for every harness-facing and control
route. Whatever is sent, the gateway answers no 5xx, every error in its protocol's format (Anthropic's
on /v1/messages, OpenAI's elsewhere), and a refused model call records nothing.

The harness routes' engine answers at once (a few fixed tokens), so that what is fuzzed is the
gateway, not a model's speed. The control routes are fuzzed on a gateway of their own, since they
pause serving, release attempts and register versions; registering a version is left out, because
it contacts the engine URLs it is given. EXAMPLES (100) cases per route, valid and invalid, keep the
file near a minute on 2 cores.
"""

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
import uvicorn
from conftest import ADMIN
from gwhelpers import admin, new_attempt
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from testsupport import Server, gateway_server

from inharness.gateway.app import create_app
from inharness.gateway.settings import GatewaySettings
from inharness.procs import free_port

EXAMPLES = 100
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure here is a regression, not luck
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def instant_engine(reply: list[int]) -> Starlette:
    """vLLM's /v1/completions with token ids, answered at once with `reply` (cut to max_tokens)."""

    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        ids = reply[: int(body["max_tokens"])]
        lp = {"token_logprobs": [-0.5] * len(ids)}
        choices = [
            {"index": i, "token_ids": ids, "logprobs": lp, "finish_reason": "stop"} for i in range(body["n"])
        ]
        if not body.get("stream"):
            return Response(orjson.dumps({"choices": choices}), media_type="application/json")

        async def events() -> Any:
            for c in choices:
                yield b"data: " + orjson.dumps({"choices": [c]}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return Response(b"{}")

    async def models(_: Request) -> Response:
        return Response(b'{"data": [{"id": "instant"}]}', media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
        ]
    )


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    from transformers import AutoTokenizer

    reply = AutoTokenizer.from_pretrained(tiny_model).encode("Five.", add_special_tokens=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(instant_engine(reply), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # bounded by the thread: a failed start ends it
        assert thread.is_alive(), "the instant engine did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def harness_gateway(
    engine_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("fuzz-harness") / "gateway.db"
    server = gateway_server(tiny_model, [engine_url], db, log_dir, admin_token=ADMIN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def control_gateway(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[Server]:
    db = tmp_path_factory.mktemp("fuzz-control") / "gateway.db"
    extra = ["--hold-seconds", "1"]  # a fuzzed pause ends by itself
    server = gateway_server(tiny_model, [], db, log_dir, admin_token=ADMIN, extra=extra).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def attempt(harness_gateway: Server) -> dict[str, Any]:
    return new_attempt(harness_gateway, lease=3600)


def operations(path_regex: str, *, exclude: tuple[str, str] | None = None) -> list[Any]:
    """The operations of the gateway's OpenAPI document whose path matches, read from the app itself
    (the document a running gateway serves), so that pytest can name one test per route."""
    doc = create_app(GatewaySettings(model="unused", admin_token=ADMIN)).openapi()
    schema = schemathesis.openapi.from_dict(doc).include(path_regex=path_regex)
    ops = [result.ok() for result in schema.get_all_operations()]
    return [op for op in ops if exclude is None or (op.method.upper(), op.path) != exclude]


def fuzz(operation: Any, call: Callable[[Any], None]) -> None:
    """`call` with EXAMPLES cases of `operation`, valid and invalid ones alike."""
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
    )

    @given(case=cases)
    @FUZZ
    def run(case: Any) -> None:
        call(case)

    run()


# The routes under /t/{token} run the same handlers; one of them stands for the key in the path.
HARNESS = operations(r"^/(v1/|t/\{token\}/v1/chat/completions$)")
CONTROL = operations(r"^/api/v1/", exclude=("POST", "/api/v1/models/versions"))


def recorded(gw: Server, attempt_id: str) -> int:
    with admin(gw) as c:
        return len(c.get(f"/api/v1/attempts/{attempt_id}/calls", params={"bodies": False}).json()["calls"])


def assert_in_protocol_format(path: str, response: Any) -> None:
    """No 5xx; an error is the protocol's own error object."""
    assert response.status_code < 500, (path, response.status_code, response.text[:500])
    if response.status_code < 400:
        return
    body = response.json()
    if "/v1/messages" in path:
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


@pytest.mark.parametrize("operation", HARNESS, ids=[op.label for op in HARNESS])
def test_harness_routes_answer_no_5xx_errors_in_their_format_and_record_nothing_refused(
    operation: Any, harness_gateway: Server, attempt: dict[str, Any]
) -> None:
    def call(case: Any) -> None:
        before = recorded(harness_gateway, attempt["id"])
        if "token" in (case.path_parameters or {}):
            case.path_parameters["token"] = attempt["token"]
        headers = {"Authorization": f"Bearer {attempt['token']}"}
        response = case.call(base_url=harness_gateway.url, headers=headers, timeout=30)
        assert_in_protocol_format(case.path, response)
        if response.status_code >= 400:
            assert recorded(harness_gateway, attempt["id"]) == before, response.text

    fuzz(operation, call)


@pytest.mark.parametrize("operation", CONTROL, ids=[op.label for op in CONTROL])
def test_control_routes_answer_no_5xx_and_errors_in_the_openai_format(
    operation: Any, control_gateway: Server
) -> None:
    def call(case: Any) -> None:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        response = case.call(base_url=control_gateway.url, headers=headers, timeout=30)
        assert_in_protocol_format(case.path, response)

    fuzz(operation, call)


def test_the_openapi_document_promises_the_errors_the_gateway_answers(harness_gateway: Server) -> None:
    doc = httpx.get(f"{harness_gateway.url}/openapi.json").json()
    for path, operations in doc["paths"].items():
        for op in operations.values():
            assert "422" not in op["responses"], path
            if path.startswith(("/v1/", "/api/v1/", "/t/")) and not path.endswith("/v1/models"):
                assert {"400", "401", "413"} <= set(op["responses"]), path
