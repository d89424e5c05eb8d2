"""An engine's refusal is not an outage: through each protocol, an engine that answers 400 reaches the
harness as a 400 in that protocol's format, naming what the engine refused, after exactly one engine
request; an engine that answers 500 is retried and reported as unavailable (503; Messages: 529).

The engine here is a stand-in (`RefusingEngine`, a thin fake on 127.0.0.1): the real `inharness engine`
answers a 400 only for requests the gateway has already refused itself, so no real request reaches
that branch. The last test sends the values an outside fuzzer found to the real engine instead."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from gwhelpers import admin, calls_of, gateway_fixture, new_attempt  # noqa: F401 (the `gateway` fixture)
from testsupport import Server

from inharness.gateway.settings import GatewaySettings

REFUSAL = "top_p 1e-50 cannot be sampled in float32"
RETRIES = GatewaySettings.model_fields["engine_retries"].default


class RefusingEngine:
    """Answers /health and /v1/models like an engine and every completion with `status`, counting them."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.completions = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer(200, {"data": [{"id": "refuser"}]} if self.path == "/v1/models" else {})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                engine.completions += 1
                self._answer(engine.status, {"error": {"message": REFUSAL, "type": "BadRequestError"}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> "RefusingEngine":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def engine_answering(gateway: Server) -> Iterator[Any]:
    """A function of a status: a RefusingEngine with it, active as model version 77 until the test ends."""
    opened: list[RefusingEngine] = []

    def activate(status: int) -> RefusingEngine:
        engine = RefusingEngine(status).__enter__()
        opened.append(engine)
        with admin(gateway) as c:
            version = {"version": 77, "engines": [engine.url], "activate": True}
            r = c.post("/api/v1/models/versions", json=version)
            assert r.is_success, r.text
        return engine

    try:
        yield activate
    finally:
        with admin(gateway) as c:
            assert c.post("/api/v1/models/active", json={"version": 0}).is_success
        for engine in opened:
            engine.__exit__()


def _call(gw: Server, protocol: str, token: str, *, stream: bool, **sampling: Any) -> httpx.Response:
    """One request in `protocol`, as its SDK sends it, with `sampling`'s fields added."""
    user = [{"role": "user", "content": "What is 2+2?"}]
    if protocol == "messages":
        path, headers = "/v1/messages", {"x-api-key": token, "anthropic-version": "2023-06-01"}
        body: dict[str, Any] = {"model": "claude-x", "max_tokens": 8, "messages": user}
    elif protocol == "responses":
        path, headers = "/v1/responses", {"authorization": f"Bearer {token}"}
        body = {"model": "gpt-x", "input": user, "max_output_tokens": 8}
    else:
        path, headers = "/v1/chat/completions", {"authorization": f"Bearer {token}"}
        body = {"model": "gpt-x", "messages": user, "max_tokens": 8}
    body = {**body, **sampling, "stream": stream}
    return httpx.post(f"{gw.url}{path}", json=body, headers=headers, timeout=60)


def _error(protocol: str, r: httpx.Response) -> tuple[str, str]:
    """(error type, message) from a protocol's error body."""
    body = r.json()
    if protocol == "messages":
        assert body["type"] == "error", body
    return body["error"]["type"], body["error"]["message"]


PROTOCOLS = ["chat", "responses", "messages"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_engine_400_is_the_harness_400_and_not_retried(
    gateway: Server, engine_answering: Any, protocol: str, stream: bool
) -> None:
    engine = engine_answering(400)
    attempt = new_attempt(gateway)
    r = _call(gateway, protocol, attempt["token"], stream=stream)
    assert r.status_code == 400, r.text
    kind, message = _error(protocol, r)
    assert kind == "invalid_request_error" and REFUSAL in message and "refused" in message
    assert engine.completions == 1  # not retried: the same request would be refused again
    assert calls_of(gateway, attempt["id"]) == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_engine_500_is_retried_and_reported_unavailable(
    gateway: Server, engine_answering: Any, protocol: str
) -> None:
    engine = engine_answering(500)
    attempt = new_attempt(gateway)
    r = _call(gateway, protocol, attempt["token"], stream=False)
    kind, message = _error(protocol, r)
    if protocol == "messages":
        assert (r.status_code, kind) == (529, "overloaded_error"), r.text
    else:
        assert (r.status_code, kind) == (503, "service_unavailable"), r.text
    assert "HTTP 500" in message
    assert engine.completions == RETRIES + 1


@pytest.mark.parametrize(
    "sampling",
    [{"top_p": 5e-324}, {"top_p": 5e-324, "temperature": 5e-324}, {"top_p": 1.0, "temperature": 1e-40}],
    ids=["top_p", "both", "temperature"],
)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_smallest_sampling_values_get_a_sampled_answer_from_the_real_engine(
    gateway: Server, protocol: str, sampling: dict[str, float]
) -> None:
    """The outside fuzzer's find end to end: the real engine answered 500 to top_p 5e-324, which the
    gateway retried four times and reported as an outage (529 on Messages)."""
    attempt = new_attempt(gateway)
    r = _call(gateway, protocol, attempt["token"], stream=False, **sampling)
    assert r.status_code == 200, r.text
    (call,) = calls_of(gateway, attempt["id"])
    assert call["response_ids"] and call["response_logprobs"]
