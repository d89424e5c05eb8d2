"""What every harness protocol shares: the attempt's key, the call skeleton, decoding, SSE framing.

An adapter turns its request into a `CallRequest` (one `Conversation`, one `Sampling`), hands it to
`answer`, and renders the decoded choices (`Decoded`, or `ChoiceStream` while streaming) in its own
wire format. Admission, tokenisation, prefix reuse, recording, keys, versions and the request
metrics are the same for every protocol because they happen here and in `CallService`.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response, StreamingResponse

from inharness.gateway.calls import CallContext, CallService, Output, Sampling, TextDecoder
from inharness.gateway.conversation import Conversation, FunctionCall, Message
from inharness.gateway.errors import APIError
from inharness.gateway.store import AttemptAuth
from inharness.gateway.toolcalls import ContentDelta, Event, ToolCall, ToolCallParser

Chunks = AsyncIterator[tuple[int, list[int], list[float], str | None]]


class OpenModel(BaseModel):
    """A request model that accepts unknown fields (SDKs and harnesses send many) and keeps them,
    so that the recorded request is what the harness sent."""

    model_config = ConfigDict(extra="allow")


def attempt_key(request: Request) -> str | None:
    """The attempt's key: from the `/t/{key}` prefix, else `Authorization: Bearer`, else `x-api-key`
    (Anthropic's header)."""
    if "token" in request.path_params:
        return request.path_params["token"]
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.headers.get("x-api-key", "").strip() or None


def sse(body: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event; `event:` names it where the protocol does (Responses, Messages)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(body) + b"\n\n"


@dataclass(frozen=True, slots=True)
class CallRequest:
    """A harness request in the call path's terms."""

    conversation: Conversation
    sampling: Sampling
    requested_model: str
    request_body: dict[str, Any]  # recorded as the harness sent it (extras included)
    notes: tuple[str, ...] = ()  # what the prompt leaves out, and why


async def answer(
    request: Request,
    *,
    protocol: str,
    id_prefix: str,
    stream: bool,
    build: Callable[[AttemptAuth], Awaitable[CallRequest]],
    complete: Callable[[CallContext], Awaitable[dict[str, Any]]],
    streamed: Callable[[CallContext, Chunks], AsyncIterator[bytes]],
) -> Response:
    """One harness call in any protocol: authenticate, `build` the call (after the key, since a
    request may refer to the attempt's earlier answers), open it, then answer plain (`complete`
    generates, records and returns the body) or streamed (`streamed` turns the engine's chunks into
    events and records before its last event)."""
    svc: CallService = request.app.state.calls
    metrics = svc.metrics
    started = time.perf_counter()
    status = "error"
    try:
        auth = await svc.authenticate(attempt_key(request))
        call = await build(auth)
        opened = svc.call(
            auth,
            call.conversation,
            call.sampling,
            protocol=protocol,
            requested_model=call.requested_model,
            request_body=call.request_body,
            id_prefix=id_prefix,
            notes=call.notes,
        )
        if stream:
            stack = AsyncExitStack()
            try:
                ctx = await stack.enter_async_context(opened)
                chunks = await ctx.open_stream()
            except BaseException:
                await stack.aclose()
                raise
            status = "ok"
            return StreamingResponse(
                _closing(streamed(ctx, chunks), stack, svc, protocol, started),
                media_type="text/event-stream",
            )
        async with opened as ctx:
            body = await complete(ctx)
        status = "ok"
        return Response(orjson.dumps(body), media_type="application/json")
    except APIError as exc:
        status = str(exc.status)
        raise
    finally:
        metrics.requests.labels(protocol, status).inc()
        if not stream:
            metrics.latency.labels(protocol).observe(time.perf_counter() - started)


async def _closing(
    events: AsyncIterator[bytes], stack: AsyncExitStack, svc: CallService, protocol: str, started: float
) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        await stack.aclose()
        svc.metrics.latency.labels(protocol).observe(time.perf_counter() - started)


def reply_message(content: str | None, calls: list[ToolCall]) -> Message:
    """The assistant turn a choice adds to the conversation (what a later turn's history echoes)."""
    return Message("assistant", content or "", tuple(FunctionCall(c.name, c.arguments) for c in calls))


class ChoiceStream:
    """One choice as it is generated: detokenised (stop strings cut) and parsed into content and
    tool calls. Plain answers feed it everything at once, so plain and streamed answers agree."""

    def __init__(self, ctx: CallContext, index: int, *, parse_tools: bool) -> None:
        self.output = Output(index)
        self.decoder = TextDecoder(ctx.service.tokenizer, ctx.sampling.stop)
        self.parser = ToolCallParser(parse_tools=parse_tools)
        self.content: list[str] = []
        self.done = False

    def events(self, ids: list[int], lps: list[float], finish: str | None) -> list[Event]:
        self.output.token_ids += ids
        self.output.logprobs += lps
        events = self.parser.feed(self.decoder.feed(ids))
        if finish is not None:
            self.output.finish_reason = finish
            events += self.parser.feed(self.decoder.finish()) + self.parser.finish()
            self.done = True
        for e in events:
            if isinstance(e, ContentDelta):
                self.content.append(e.text)
        return events

    @property
    def text(self) -> str | None:
        return "".join(self.content) or None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.tool_calls

    def reply(self) -> Message:
        return reply_message(self.text, self.tool_calls)


def decode(ctx: CallContext, output: Output, *, parse_tools: bool) -> ChoiceStream:
    """A whole generated choice, decoded as a stream fed at once."""
    s = ChoiceStream(ctx, output.index, parse_tools=parse_tools)
    s.events(output.token_ids, output.logprobs, output.finish_reason)
    return s
