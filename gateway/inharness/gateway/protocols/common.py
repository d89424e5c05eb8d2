"""What every harness protocol shares: the attempt's key, the call skeleton, decoding, SSE framing.

An adapter turns its request into a `CallRequest` (one `Conversation`, one `Sampling`), hands it to
`answer`, and renders the decoded choices (`Decoded`, or `ChoiceStream` while streaming) in its own
wire format. Admission, tokenisation, prefix reuse, recording, keys, versions and the request
metrics are the same for every protocol because they happen here and in `CallService`.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response, StreamingResponse

from inharness.gateway.calls import (
    CLIENT_GONE,
    CallContext,
    CallService,
    Output,
    Sampling,
    TextDecoder,
)
from inharness.gateway.conversation import Conversation, FunctionCall, Message
from inharness.gateway.errors import APIError, ErrorFormat, error_response, protocol_route
from inharness.gateway.prompts import CLIENT_CUT
from inharness.gateway.store import AttemptAuth
from inharness.gateway.toolcalls import ContentDelta, Event, ToolCall, ToolCallParser

Chunks = AsyncIterator[tuple[int, list[int], list[float], str | None]]


class OpenModel(BaseModel):
    """A request model that accepts unknown fields (SDKs and harnesses send many) and keeps them,
    so that the recorded request is what the harness sent."""

    model_config = ConfigDict(extra="allow")


def harness_route(fmt: ErrorFormat = error_response, *, protocol: str | None = None) -> type[APIRoute]:
    """The route class of a harness-facing router: errors in `fmt`, and the attempt's key checked
    before a byte of the body is read (`errors.protocol_route`; GET routes need none). A refused
    key counts in the request metrics under `protocol`; the endpoint authenticates again, from the
    key cache."""

    async def authenticate(request: Request) -> None:
        if request.method == "GET":
            return
        svc: CallService = request.app.state.calls
        try:
            await svc.authenticate(attempt_key(request))
        except APIError as exc:
            if protocol is not None:
                svc.metrics.requests.labels(protocol, str(exc.status)).inc()
            raise

    return protocol_route(fmt, authenticate=authenticate)


def type_tag(value: Any, missing: str | None = None) -> str | None:
    """The `type` of a union member as a discriminator reads it, from a dict or a model (`missing`
    when it has none); "" when it is no string (a hostile `{"type": []}`), so that such a value
    fails validation as the "other" member instead of failing the discriminator itself (a 500)."""
    kind = value.get("type", missing) if isinstance(value, dict) else getattr(value, "type", missing)
    return kind if isinstance(kind, str) or kind is missing else ""


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
            client_gone=request.is_disconnected,
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
                _closing(streamed(ctx, chunks), stack, ctx, protocol, started),
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
    events: AsyncIterator[bytes], stack: AsyncExitStack, ctx: CallContext, protocol: str, started: float
) -> AsyncIterator[bytes]:
    """The stream's events, then the call's exit. A stream cut off by its client (the transport stops
    asking for events) before the call was recorded is recorded as far as it was sent (`_record_cut`)."""
    metrics = ctx.service.metrics
    try:
        async for event in events:
            yield event
    except BaseException:
        if not ctx.recorded and ctx.dropped is None:
            with anyio.CancelScope(shield=True):  # the request's scope is being cancelled
                await _record_cut(ctx)
        raise
    finally:
        await stack.aclose()  # closes the engine's stream: the engine stops generating
        metrics.latency.labels(protocol).observe(time.perf_counter() - started)


async def _record_cut(ctx: CallContext) -> None:
    """Record a cut stream's sent tokens with finish reason `CLIENT_CUT`; one whose harness was sent no
    token counts as dropped (`CLIENT_GONE`): there is nothing of it to learn from."""
    sent = ctx.sent_so_far() if ctx.sent_so_far is not None else None
    if sent is None or not any(o.token_ids for o in sent[0]):
        ctx.service.dropped(ctx, CLIENT_GONE)  # counted; its error has nobody left to read it
        return
    with suppress(APIError):  # its attempt ended meanwhile: counted as dropped by `record`
        await ctx.record(*sent, cut=True)


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
        self.sent = 0  # how many of output.token_ids the harness has been sent the events of

    def mark_sent(self) -> None:
        """The events of every token so far have been written to the harness's transport."""
        self.sent = len(self.output.token_ids)

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


def track_sent(ctx: CallContext, states: list[ChoiceStream], *, parse_tools: bool) -> None:
    """Let a cut stream be recorded as sent: each choice's tokens up to its last `mark_sent`, decoded as
    a plain answer, finish reason `CLIENT_CUT`, and a protocol-neutral body (the protocol's own final
    body was never sent)."""

    def sent_so_far() -> tuple[list[Output], list[Message], dict[str, Any]]:
        outputs, replies, choices = [], [], []
        for s in states:
            o = Output(s.output.index, s.output.token_ids[: s.sent], s.output.logprobs[: s.sent], CLIENT_CUT)
            d = decode(ctx, o, parse_tools=parse_tools)
            outputs.append(o)
            replies.append(d.reply())
            calls = [{"name": c.name, "arguments": c.arguments} for c in d.tool_calls]
            choices.append({"index": o.index, "content": d.text, "tool_calls": calls})
        body = {"id": ctx.request_id, "model": ctx.requested_model, "finish_reason": CLIENT_CUT}
        return outputs, replies, {**body, "choices": choices}

    ctx.sent_so_far = sent_so_far
